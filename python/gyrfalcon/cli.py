"""Command line: `gyrfalcon serve`, `gyrfalcon bench serve`, `gyrfalcon convert`,
`gyrfalcon train-eagle3`."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from gyrfalcon.config.server_args import ServerArgs


def _serve(argv: list[str]) -> int:
    from gyrfalcon.frontend.auth import resolve_api_key

    parser = argparse.ArgumentParser(prog="gyrfalcon serve", description="Start the server.")
    ServerArgs.add_cli_args(parser)
    try:
        args = ServerArgs.from_cli_args(parser.parse_args(argv))
        args = dataclasses.replace(args, api_key=resolve_api_key(args.api_key))
    except ValueError as e:  # NOTE: a bad combination of flags, before anything loads
        parser.error(str(e))
    if args.node_rank > 0:  # NOTE: not the head: this node's ranks only
        from gyrfalcon.node import serve_node

        return serve_node(args)
    from gyrfalcon.launch import serve

    return serve(args)


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] != "serve":
        print("usage: gyrfalcon bench serve [options]", file=sys.stderr)
        return 2
    from gyrfalcon.bench.serving import main

    return main(argv[1:])


def _convert(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="gyrfalcon convert", description="Convert a GGUF file into an HF directory."
    )
    parser.add_argument("gguf", help="path of the .gguf file")
    parser.add_argument("out_dir", help="output directory")
    ns = parser.parse_args(argv)
    from gyrfalcon.loader.gguf_convert import convert_gguf_to_hf

    print(convert_gguf_to_hf(ns.gguf, ns.out_dir))
    return 0


def _train_eagle3(argv: list[str]) -> int:
    from gyrfalcon.train.trainer import main

    return main(argv)


COMMANDS = {"serve": _serve, "bench": _bench, "convert": _convert, "train-eagle3": _train_eagle3}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        if argv and argv[0] in ("-V", "--version"):
            from gyrfalcon import __version__

            print(__version__)
            return 0
        print(f"usage: gyrfalcon {{{','.join(COMMANDS)}}} ...", file=sys.stderr)
        return 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
