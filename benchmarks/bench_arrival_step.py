#!/usr/bin/env python3
"""Host and device time of an arrival step: one prompt beside N decoding rows.

A served small model at high concurrency keeps admitting prompts beside its decoding
rows; each such step is a MIXED forward no decode graph serves. It runs eagerly,
through piecewise graphs, or as one whole graph (worker/piecewise_graph.py), by its
token count against `--piecewise-cuda-graph-max-tokens`. This runs the in-process
engine to N running requests, then for each of `--arrivals` steps adds one prompt and
times the target's forward: host seconds until it returns, and the device's from CUDA
events around it (the device idle before: each step synchronizes first). The decode
steps between the arrivals are timed too. Figures are medians per kind of step.

    python benchmarks/bench_arrival_step.py --piecewise-max-tokens 512 8448 \\
        --output-json arrival.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

try:
    import gyrfalcon  # noqa: F401
except ImportError:  # a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import torch

from gyrfalcon.bench import report_json
from gyrfalcon.bench.provenance import git_commit
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.engine import LocalEngine
from gyrfalcon.gc_heap import freeze_startup_heap
from gyrfalcon.ipc.messages import GenerateRequest, SamplingParams

# NOTE: no request ends while measured: the running rows stay N (+ the arrivals)
ENDLESS = SamplingParams(max_tokens=1 << 20, ignore_eos=True, temperature=0.0)


def prompt(rid: str, first: int, second: int, length: int, vocab: int) -> GenerateRequest:
    """A prompt whose first two tokens differ from every other's: no prefix-cache hit."""
    rest = [5 + j % min(1000, vocab - 5) for j in range(length - 2)]
    return GenerateRequest(rid, [first % vocab, second % vocab] + rest, ENDLESS)


def run(a: argparse.Namespace, max_tokens: int) -> list[tuple[str, int, float, float]]:
    """(kind, tokens, host ms, device ms) of each forward after the N rows run."""
    cuda = a.device == "cuda"
    args = ServerArgs(
        model=a.model, load_format=a.load_format, device=a.device, dtype=a.dtype,
        attention_backend=a.attention_backend, max_num_seqs=a.rows + a.arrivals + 1,
        num_kv_pages=a.num_kv_pages, piecewise_cuda_graph_max_tokens=max_tokens,
        static_graph_replay=not cuda, disable_overlap_schedule=True,
        schedule_conservativeness=0.0,  # NOTE: endless requests reserve no future pages
    )  # fmt: skip
    eng = LocalEngine(args, a.model, check_invariants=False)
    freeze_startup_heap()
    vocab = eng.model_cfg.vocab_size
    for i in range(a.rows):
        eng.scheduler.add_request(prompt(f"r{i}", 3 + i, 7, a.prompt_len, vocab))
    while len(eng.scheduler.running) < a.rows or eng.scheduler.waiting:
        for out in eng.step():
            assert out.finish_reason is None, f"{out.rid} ended: {out.finish_reason}"
    ex, timed = eng.worker.executor, []
    forward = ex.forward

    def measured(mode, bt, *args, **kw):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else []
        if cuda:
            torch.cuda.synchronize()
            events[0].record()
        t0 = time.perf_counter()
        out = forward(mode, bt, *args, **kw)
        host = time.perf_counter() - t0
        device = 0.0
        if cuda:
            events[1].record()
            torch.cuda.synchronize()
            device = events[0].elapsed_time(events[1])
        timed.append((out.ran, int(bt.input_ids.shape[0]), 1e3 * host, device))
        return out

    ex.forward = measured
    for n in range(a.arrivals):
        eng.scheduler.add_request(prompt(f"a{n}", 3 + n, 100 + n, a.prompt_len, vocab))
        for _ in range(1 + a.decodes_between):
            eng.step()
    return timed


def summary(timed: list[tuple[str, int, float, float]]) -> dict[str, dict]:
    out = {}
    for kind in sorted({k for k, *_ in timed}):
        rows = [t for t in timed if t[0] == kind]
        out[kind] = {
            "steps": len(rows),
            "tokens_median": statistics.median(t[1] for t in rows),
            "host_ms_median": round(statistics.median(t[2] for t in rows), 3),
            "device_ms_median": round(statistics.median(t[3] for t in rows), 3),
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="benchmarks/models/smollm2-135m")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--rows", type=int, default=240, help="decoding requests")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--arrivals", type=int, default=8, help="steps measured, a prompt each")
    p.add_argument("--decodes-between", type=int, default=2)
    p.add_argument("--num-kv-pages", type=int, default=40000)
    p.add_argument("--piecewise-max-tokens", type=int, nargs="+", default=[512, 8448])
    p.add_argument("--device-kind", default="unknown")
    p.add_argument("--output-json")
    a = p.parse_args()
    runs = []
    for max_tokens in a.piecewise_max_tokens:
        kinds = summary(run(a, max_tokens))
        runs.append({"piecewise_max_tokens": max_tokens, "kinds": kinds})
        for kind, s in kinds.items():
            print(
                f"max {max_tokens:6d} {kind:>9}: {s['steps']:3d} steps of "
                f"~{s['tokens_median']:.0f} tokens, host {s['host_ms_median']:.2f} ms, "
                f"device {s['device_ms_median']:.2f} ms"
            )
    report = {
        "bench": "arrival_step",
        "device_kind": a.device_kind,
        "commit": git_commit(),
        "model": a.model,
        "attention_backend": a.attention_backend,
        "rows": a.rows,
        "prompt_len": a.prompt_len,
        "runs": runs,
    }
    if a.output_json:
        report_json.write(a.output_json, report)


if __name__ == "__main__":
    main()
