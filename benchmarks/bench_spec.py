#!/usr/bin/env python3
"""EAGLE3 speculative decoding against plain decoding, on MT-Bench's first turns.

Starts `gyrfalcon serve MODEL` twice, one after the other: plain, then with
`--speculative-algorithm EAGLE3 --speculative-draft-model-path DRAFT
--speculative-num-steps K` (with --rounds R > 1 both at once, the requests sent to
them in alternating rounds). At each concurrency of --concurrency, each server
answers the first turn of every question of --dataset as a greedy chat
completion (temperature 0, --max-tokens, EOS honoured), at most that many in
flight. Per concurrency it reports:

* acceptance length, tokens emitted per verify step (accepted drafts + 1): token-
  weighted (total completion tokens / total verify steps; the prefill's first
  token counted too) and the mean of the requests' `usage.spec_accept_length`;
* output tokens/s of each server (completion tokens / wall time) and the speed-up;
* mismatches: requests whose greedy output (text, token count or finish reason)
  differs between the two servers. Speculative decoding must never change an
  output: in float32 anything but 0 is a bug (the exit code is then 1). In bf16 a
  verify step's rows go through other kernels than a decode step's and near-ties
  flip, as they do between batch sizes: the plain outputs are also compared with the
  plain outputs at the first concurrency, the scale of that drift.

--ab-trees DIR,... (with --rounds) adds an EAGLE3 server per source tree (DIR/python:
`benchmarks/ab_trees.sh` makes them), up beside the other two and sent every round in
turn: an A/B of code on one machine at one time, against the one plain server.

Writes spec_<tag>_k<K>_<device-kind>.json and .md into --output-dir. Unknown flags
go to both servers (`gyrfalcon serve --help`), e.g. `--load-format dummy --tokenizer DIR`.

    python benchmarks/bench_spec.py --device cpu --dtype float32 --device-kind cpu-2core
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

try:
    import gyrfalcon  # noqa: F401
except ImportError:  # running from a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from gyrfalcon.bench import report_json
from gyrfalcon.bench.client import ENDPOINT_PATHS, ERROR_BODY_CHARS, build_payload, fetch_model_ids
from gyrfalcon.bench.datasets import SampleRequest, load_jsonl_requests
from gyrfalcon.bench.server_proc import pages_after, running_server
from gyrfalcon.bench.spec_report import (
    ChatOutput,
    RoundFigures,
    Runs,
    build_report,
    cycled,
    format_markdown,
    parse_chat_response,
    throughput,
)
from gyrfalcon.loader.resolve import default_model_name
from gyrfalcon.utils import free_port

ROOT = Path(__file__).resolve().parents[1]
# NOTE: shared/ sits beside the checkout here, inside the copy on the GPU machine
SHARED = next((p for p in (ROOT.parent / "shared", ROOT / "shared") if p.is_dir()), ROOT / "shared")


@dataclass(frozen=True)
class SpecBenchDefaults:
    """Every default of the benchmark, in one place."""

    dataset: str = str(SHARED / "data" / "mt_bench_dev.jsonl")
    draft_model: str = str(SHARED / "models" / "smollm2-eagle3")
    num_steps: int = 3
    max_tokens: int = 256
    concurrency: str = "1,16"
    min_waves: int = 0
    rounds: int = 1
    device: str = "auto"
    dtype: str = "auto"
    output_dir: str = str(ROOT / "benchmarks" / "results")
    device_kind: str = "unknown"
    startup_timeout_s: float = 900.0
    stop_timeout_s: float = 60.0
    request_timeout_s: float = 3600.0
    health_poll_s: float = 1.0


DEFAULTS = SpecBenchDefaults()


def parse_concurrency(text: str) -> list[int]:
    """'1,16' -> [1, 16] (order kept, repeats dropped); ValueError below 1."""
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"--concurrency needs integers >= 1, got {text!r}")
    return list(dict.fromkeys(values))


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """(this benchmark's flags, the flags passed through to both servers)."""
    d = DEFAULTS
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Unknown flags go to both servers (gyrfalcon serve --help).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--model", default=None, help="target (default: the embedded SmolLM2)")
    p.add_argument("--draft-model", default=d.draft_model, help="EAGLE3 drafter directory")
    p.add_argument("--num-steps", type=int, default=d.num_steps, help="draft tokens per step, k")
    p.add_argument("--dataset", default=d.dataset, help="jsonl with 'turns' (first one is sent)")
    p.add_argument("--num-prompts", type=int, default=None, help="first N questions (all)")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens)
    p.add_argument("--concurrency", type=parse_concurrency, default=d.concurrency)
    p.add_argument(
        "--min-waves",
        type=int,
        default=d.min_waves,
        help="at concurrency C send max(prompts, W * C) requests, the prompts cycled: a run "
        "of 40 prompts at C = 16 lasts ~1 s on a GPU, mostly ramp and tail",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=d.rounds,
        help="R >= 2: both servers up at once and, at each concurrency, R rounds of the "
        "requests, each round sent to one server then the other (the order alternating); "
        "the figures sum every round. A machine drifts between two runs (a server's c1 "
        "figure moved 13%% between back-to-back runs on one H100): rounds put that drift "
        "on both servers alike. Needs --kv-cache-memory, so the two servers fit",
    )
    p.add_argument(
        "--spec-flags",
        type=shlex.split,
        default=[],
        help="more `gyrfalcon serve` flags for the EAGLE3 server only, one string (e.g. "
        "'--separate-prefill-steps'): a scheduling choice measured against the same plain "
        "server",
    )
    p.add_argument(
        "--ab-trees",
        type=lambda text: [t for t in text.split(",") if t],
        default=[],
        help="source trees (DIR/python, e.g. .ab/<commit> from benchmarks/ab_trees.sh), "
        "comma-separated: an EAGLE3 server from each, up beside the two and in the same "
        "rounds (needs --rounds >= 2), named spec@<DIR's last part>. Runs one after the "
        "other moved a speed-up 0.1-0.2x between machines and 10%% within one",
    )
    p.add_argument("--device", default=d.device, help="server --device")
    p.add_argument("--dtype", default=d.dtype, help="server --dtype")
    p.add_argument("--device-kind", default=d.device_kind, help="machine label, in file names")
    p.add_argument("--tag", default=None, help="name in the files (default: from the model)")
    p.add_argument("--output-dir", default=d.output_dir)
    p.add_argument("--log-dir", default=None, help="server logs (default: a temp dir)")
    p.add_argument("--startup-timeout", type=float, default=d.startup_timeout_s)
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    ns, extra = p.parse_known_args(argv)  # NOTE: the string default goes through `type` too
    if ns.num_steps < 1 or ns.max_tokens < 1 or ns.rounds < 1:
        p.error("--num-steps, --max-tokens and --rounds must be >= 1")
    if ns.ab_trees and ns.rounds < 2:
        p.error("--ab-trees runs its servers beside the others: give --rounds >= 2")
    if ns.rounds > 1 and not any(a.split("=")[0] == "--kv-cache-memory" for a in extra):
        p.error("--rounds > 1 runs both servers at once: give --kv-cache-memory (e.g. 8GiB)")
    return ns, extra


def file_tag(ns: argparse.Namespace) -> str:
    """spec_<tag>_k<K>_<device-kind>: the stem of the result files."""
    tag = ns.tag or re.sub(r"[^a-z0-9.]+", "-", default_model_name(ns.model).lower()).strip("-")
    return f"spec_{tag}_k{ns.num_steps}_{ns.device_kind}"


def server_command(
    ns: argparse.Namespace, extra: Sequence[str], port: int, spec: bool
) -> list[str]:
    """The `gyrfalcon serve` command line of the plain (spec=False) or EAGLE3 server."""
    cmd = [sys.executable, "-m", "gyrfalcon.cli", "serve", *([ns.model] if ns.model else [])]
    cmd += ["--port", str(port), "--device", ns.device, "--dtype", ns.dtype, *extra]
    if spec:
        cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path"]
        cmd += [ns.draft_model, "--speculative-num-steps", str(ns.num_steps), *ns.spec_flags]
    return cmd


# ---------------------------------------------------------------- one request


def chat_payload(model: str, sample: SampleRequest) -> dict[str, Any]:
    """The bench client's greedy chat body, sent whole (not streamed): usage comes back."""
    payload = build_payload("chat", model, sample)
    payload.pop("stream_options")
    payload["stream"] = False
    return payload


async def send_chat(session: aiohttp.ClientSession, url: str, payload: dict) -> ChatOutput:
    """POST one chat completion; failures come back as ChatOutput.error, never raised."""
    start = time.perf_counter()
    try:
        async with session.post(url, json=payload) as response:
            if response.status != 200:
                body = (await response.text())[:ERROR_BODY_CHARS]
                raise RuntimeError(f"HTTP {response.status}: {body}")
            out = parse_chat_response(await response.json())
    except Exception as e:  # noqa: BLE001 -- a failed request is data, not a crash
        out = ChatOutput(error=f"{type(e).__name__}: {e}")
    out.latency_s = time.perf_counter() - start
    return out


async def run_batch(
    session: aiohttp.ClientSession, url: str, payloads: Sequence[dict], concurrency: int
) -> tuple[list[ChatOutput], float]:
    """Every payload, at most `concurrency` in flight: outputs in order, wall time."""
    limiter = asyncio.Semaphore(concurrency)

    async def one(payload: dict) -> ChatOutput:
        async with limiter:
            return await send_chat(session, url, payload)

    start = time.perf_counter()
    outputs = list(await asyncio.gather(*(one(p) for p in payloads)))
    return outputs, time.perf_counter() - start


async def run_rounds(
    base_urls: dict[str, str],
    samples: Sequence[SampleRequest],
    concurrencies: Sequence[int],
    timeout: float,
    min_waves: int = 0,
    rounds: int = 1,
) -> tuple[dict[str, Runs], RoundFigures]:
    """After one untimed warm-up request to each server, at each concurrency `rounds`
    rounds of run_batch (its requests `cycled` to `min_waves` waves), each round on every
    server in turn (the order of base_urls in even rounds, reversed in odd ones): per
    server its outputs in order over the rounds and the sum of their wall times, and
    each round's figures."""
    client_timeout = aiohttp.ClientTimeout(total=timeout)
    connector = aiohttp.TCPConnector(limit=0)
    runs: dict[str, Runs] = {name: {} for name in base_urls}
    figures: RoundFigures = {name: {} for name in base_urls}
    async with aiohttp.ClientSession(timeout=client_timeout, connector=connector) as session:
        payloads = {}
        for name, base_url in base_urls.items():
            model = (await fetch_model_ids(session, base_url))[0]
            payloads[name] = [chat_payload(model, s) for s in samples]
            warm = await send_chat(session, base_url + ENDPOINT_PATHS["chat"], payloads[name][0])
            if not warm.ok:
                raise RuntimeError(f"warm-up request failed ({name}): {warm.error}")
        for c in concurrencies:
            for r in range(rounds):
                for name in list(base_urls)[:: 1 if r % 2 == 0 else -1]:
                    url = base_urls[name] + ENDPOINT_PATHS["chat"]
                    outs, wall = await run_batch(
                        session, url, cycled(payloads[name], c, min_waves), c
                    )
                    done, total = runs[name].get(c, ([], 0.0))
                    runs[name][c] = (done + outs, total + wall)
                    tokens = throughput(outs, wall)["output_tokens"]
                    figures[name].setdefault(c, []).append((tokens, wall))
    return runs, figures


async def run_concurrencies(
    base_url: str,
    samples: Sequence[SampleRequest],
    concurrencies: Sequence[int],
    timeout: float,
    min_waves: int = 0,
) -> Runs:
    """One server's `run_rounds`, one round."""
    runs, _ = await run_rounds({"server": base_url}, samples, concurrencies, timeout, min_waves)
    return runs["server"]


def main(argv: Sequence[str] | None = None) -> int:
    """Serve plain, then EAGLE3; run every concurrency on each; write JSON + markdown.
    Exit code 1 when any output differs, any request failed, or a server did not get
    every KV page back."""
    ns, extra = parse_args(argv)
    samples = load_jsonl_requests(ns.dataset, ns.max_tokens, ns.num_prompts)
    samples = [dataclasses.replace(s, output_len=ns.max_tokens) for s in samples]
    log_dir = Path(ns.log_dir or tempfile.mkdtemp(prefix="bench_spec_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    commands: dict[str, list[str]] = {}
    runs: dict[str, Runs] = {}
    figures: RoundFigures = {}
    pages: dict[str, dict[str, Any]] = {}  # each server's KV pages after its runs

    def serve(name: str, spec: bool, tree: Path = ROOT) -> contextlib.AbstractContextManager[str]:
        port = free_port()
        commands[name] = cmd = server_command(ns, extra, port, spec)
        log = log_dir / f"server_{name.replace('@', '_')}.log"
        return running_server(cmd, port, log, ns.startup_timeout, tree / "python",
                              DEFAULTS.health_poll_s, DEFAULTS.stop_timeout_s)  # fmt: skip

    def measure(urls: dict[str, str]) -> None:
        got, rounds = asyncio.run(
            run_rounds(urls, samples, ns.concurrency, ns.request_timeout, ns.min_waves, ns.rounds)
        )
        runs.update(got)
        figures.update(rounds)
        pages.update({name: pages_after(url) for name, url in urls.items()})

    servers = [("plain", False, ROOT), ("spec", True, ROOT)]
    servers += [(f"spec@{Path(t).resolve().name}", True, Path(t).resolve()) for t in ns.ab_trees]
    try:
        if ns.rounds == 1:  # NOTE: one server at a time, the whole device each
            for name, spec, tree in servers:
                with serve(name, spec, tree) as url:
                    measure({name: url})
        else:
            with contextlib.ExitStack() as stack:
                urls = {s[0]: stack.enter_context(serve(*s)) for s in servers}
                measure(urls)
    except (RuntimeError, aiohttp.ClientError, OSError) as e:
        print(f"error (servers {', '.join(commands)}): {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    report = build_report(
        ns, extra, len(samples), commands, runs, figures if ns.rounds > 1 else None
    )
    report["pages"] = pages
    out = Path(ns.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / file_tag(ns)  # NOTE: not with_suffix: tags such as llama-3.1-8b hold dots
    report_json.write(f"{stem}.json", report)
    markdown = format_markdown(report)
    Path(f"{stem}.md").write_text(markdown)
    print(markdown + f"Wrote {stem}.json, {stem}.md (server logs in {log_dir})")
    rows = report["rows"] + [r for tree in report.get("ab_rows", {}).values() for r in tree]
    if not any(r["acceptance"]["requests_with_spec_usage"] for r in rows):
        print("warning: the EAGLE3 server reported no spec_verify_steps in usage", file=sys.stderr)
    # NOTE: float32 (what "auto" is on the CPU); elsewhere mismatches are numerics
    exact = ns.dtype == "float32" or ns.dtype == "auto" and not ns.device.startswith("cuda")
    bad = any(
        r["plain_vs_spec"]["failed_pairs"] or exact and r["plain_vs_spec"]["mismatches"]
        for r in rows
    )
    leaked = [name for name, p in pages.items() if not p["ok"]]
    if leaked:
        print(f"error: KV pages not all back after the runs: {', '.join(leaked)}", file=sys.stderr)
    return 1 if bad or leaked else 0


if __name__ == "__main__":
    sys.exit(main())
