#!/usr/bin/env python3
"""Drafters against the first, on the same prompts: acceptance in rounds, the
difference, and its paired bootstrap 95% interval (gyrfalcon.bench.drafter_compare).

    python benchmarks/compare_drafters.py base.json variant1.json lr2e-3=variant2.json

Each JSON is `benchmarks/eval_drafter.py --output-json` from one machine (the same
answers; its `rounds_per_sequence`). NAME=PATH names a row (default: the file's name)."""

from __future__ import annotations

import argparse
import json
import os

from gyrfalcon.bench.drafter_compare import in_rounds, paired_difference


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base", help="eval_drafter.py JSON of the drafter compared against")
    p.add_argument("others", nargs="+", help="eval_drafter.py JSONs of the other drafters")
    p.add_argument("--resamples", type=int, default=10000)
    a = p.parse_args()

    def label(arg: str) -> tuple[str, str]:  # NAME=PATH or PATH -> (name, path)
        name, sep, path = arg.partition("=")
        return (name, path) if sep and os.path.exists(path) else (os.path.basename(arg), arg)

    def rounds(path: str) -> list[list[int]]:
        with open(path) as f:
            data = json.load(f)
        if "rounds_per_sequence" not in data:
            raise SystemExit(f"{path}: no rounds_per_sequence (an older eval_drafter.py)")
        return data["rounds_per_sequence"]

    base_name, base_path = label(a.base)
    base = rounds(base_path)
    print("| drafter | in rounds | minus the first | 95% interval |")
    print("| --- | ---: | ---: | --- |")
    print(f"| {base_name} | {in_rounds(base):.3f} | | |")
    for arg in a.others:
        name, path = label(arg)
        d = paired_difference(base, rounds(path), a.resamples)
        print(f"| {name} | {d.b:.3f} | {d.delta:+.3f} | "
              f"[{d.low:+.3f}, {d.high:+.3f}] |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
