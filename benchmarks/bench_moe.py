#!/usr/bin/env python3
"""MoE expert layer: the fused Triton kernel (`kernels/fused_moe.fused_moe`) against the
torch reference (`layers/moe.moe_reference`, a host-synced loop over the routed experts).

For one model's expert shape (--model: Qwen3-30B-A3B H 2048, I 768, E 128, k 8 by
default; Mixtral-8x7B H 4096, I 14336, E 8, k 2) and T in --tokens, routes T random
tokens through a random router (softmax top-k, renormalized) and times, with CUDA
events around --iters back-to-back calls,
- the reference (eager: it asks the host which experts have tokens),
- `fused_moe` eager (launch overhead included),
- `fused_moe` replayed in a CUDA graph (`time_graph`: how decode runs it).
The calls cycle through enough copies of the expert weights (>= 100 MB apart from the
routed ones) that L2 never holds them, as in a model whose other layers run between.
Every T is checked first: fused against the reference (max error over max |ref|), and
a graph captured once and replayed after new ids and weights were copied into its
static inputs (the graph-safety contract: grids and buffers depend on shapes only).
GB/s counts the routed experts' weight bytes once per call; TFLOP/s counts 6 T k H I.
--ep N times one rank's share under expert parallelism (DP attention + EP N: every
rank's tokens gathered): E / N local experts, the pairs routed to the others' skipped,
the kernel's blocks sized for the pairs routed over all E (`routed_experts`); it also
times the blocks a config from the local E alone would pick (`local_config_graph_us`).
--tp N times one rank's share under MoE-TP N instead: every expert, I / N of its
intermediate rows (the same bytes a rank reads as under EP N, in narrower tiles).

    PYTHONPATH=python python3 benchmarks/bench_moe.py --device cuda --out moe.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from pathlib import Path

import torch

try:
    import gyrfalcon  # noqa: F401
except ImportError:  # running from a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from gyrfalcon.bench.provenance import git_commit  # noqa: E402

# name: (hidden H, expert intermediate I, experts E, top-k)
MODELS = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}
ROTATE_BYTES = 100 << 20  # weight bytes between two uses of one copy (> L2)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
MAX_REL_ERR = 2**-6  # fused vs reference, relative to max |reference|


class Case:
    """One (model, T): expert weight copies, tokens and their routing."""

    def __init__(
        self, model: str, tokens: int, dtype: torch.dtype, seed: int, ep: int = 1, tp: int = 1
    ):
        hidden, inter, experts, top_k = MODELS[model]
        assert ep == 1 or tp == 1, "a rank's experts split one way: EP or MoE-TP"
        assert inter % tp == 0 and experts % ep == 0, (inter, tp, experts, ep)
        inter //= tp  # MoE-TP: this rank's intermediate rows of every expert
        self.routed_experts = experts
        self.local = local = experts // ep  # rank 0's experts [0, local); the rest skipped
        dev = torch.device("cuda")
        gen = torch.Generator(device=dev).manual_seed(seed)
        self.model, self.tokens, self.top_k = model, tokens, top_k
        self.hidden, self.inter = hidden, inter
        w13 = torch.randn(local, 2 * inter, hidden, device=dev, generator=gen) * hidden**-0.5
        w2 = torch.randn(local, hidden, inter, device=dev, generator=gen) * inter**-0.5
        self.x = torch.randn(tokens, hidden, device=dev, generator=gen).to(dtype)
        self.router = torch.randn(experts, hidden, device=dev, generator=gen).to(dtype) * 0.1
        self.weights, self.ids = self.route(self.x)
        live = self.ids[self.ids >= 0]
        self.live_pairs = int(live.numel())  # NOTE: syncs, outside any timing
        routed = int(live.unique().numel())
        self.routed_bytes = routed * 3 * inter * hidden * dtype.itemsize
        copies = 1 + -(-ROTATE_BYTES // max(self.routed_bytes, 1))
        self.w13 = [w13.to(dtype)] + [w13.roll(i, 0).to(dtype) for i in range(1, copies)]
        self.w2 = [w2.to(dtype)] + [w2.roll(i, 0).to(dtype) for i in range(1, copies)]
        del w13, w2

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from gyrfalcon.layers.moe import route_topk

        logits = x @ self.router.T
        weights, ids = route_topk(logits, self.top_k, renormalize=True, weights_fp32=False)
        return weights, ids.masked_fill(ids >= self.local, -1)  # other ranks' experts

    def flops(self) -> float:
        return 6.0 * self.live_pairs * self.hidden * self.inter


def time_events(fn, iters: int) -> float:
    """Median-of-3 microseconds per call of `iters` back-to-back eager calls."""
    fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        runs.append(1e3 * start.elapsed_time(end) / iters)
    return sorted(runs)[1]


def check_graph_replay(case: Case, fused_moe, reference) -> float:
    """Capture fused_moe once on static inputs, copy in other tokens and routing, replay:
    the max error against the reference on the new inputs, over max |reference|."""
    x, (w, ids) = case.x.clone(), (case.weights.clone(), case.ids.clone())
    w13, w2 = case.w13[0], case.w2[0]
    fused_moe(x, w13, w2, w, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, w, ids)
    new_x = torch.randn_like(x)
    new_w, new_ids = case.route(new_x)
    if new_ids.numel():
        new_ids[0, -1] = -1  # a skipped slot (another rank's expert under EP)
    for static, new in ((x, new_x), (w, new_w), (ids, new_ids)):
        static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    return rel_err(out, reference(new_x, w13, w2, new_w, new_ids))


def rel_err(out: torch.Tensor, want: torch.Tensor) -> float:
    if want.numel() == 0:
        return 0.0
    scale = want.float().abs().max().item() or 1.0
    return (out.float() - want.float()).abs().max().item() / scale


def sweep_configs(num_pairs: int, experts: int) -> list:
    """The --sweep grid: tiles whose gate_up pipeline fits 200 KB of shared memory and
    whose two float32 accumulators take <= 128 registers a thread; BLOCK_M at most
    twice the mean rows per expert (rounded up to a power of two, >= 16)."""
    from gyrfalcon.kernels.fused_moe import MoeConfig

    rows = max(16, 1 << max(0, num_pairs // experts - 1).bit_length())
    out = []
    grid = itertools.product((16, 32, 64, 128), (32, 64, 128), (64, 128), ((4, 3), (4, 4), (8, 3)))
    for bm, bn, bk, (warps, stages) in grid:
        smem = stages * (bm + 2 * bn) * bk * 2
        if bm <= 2 * rows and smem <= 200 << 10 and 2 * bm * bn // (32 * warps) <= 128:
            out.append(MoeConfig(bm, bn, bk, warps, stages))
    return out


def sweep(case: Case, ns: argparse.Namespace, want: torch.Tensor) -> dict:
    """Graph-replay us of every `sweep_configs` candidate that matches the reference."""
    from gyrfalcon.bench.graph_timing import time_graph
    from gyrfalcon.kernels.fused_moe import fused_moe

    x, w, ids = case.x, case.weights, case.ids
    copies = list(zip(case.w13, case.w2))
    calls = max(ns.iters, len(copies))
    timed = {}
    for cfg in sweep_configs(case.tokens * case.top_k, case.routed_experts):
        name = f"m{cfg.block_m}/n{cfg.block_n}/k{cfg.block_k}/w{cfg.num_warps}/s{cfg.num_stages}"
        try:
            got = fused_moe(x, case.w13[0], case.w2[0], w, ids, config=cfg)
            if rel_err(got, want) > MAX_REL_ERR:
                raise AssertionError(f"error {rel_err(got, want):.2e}")
            fns = [
                lambda c=c, cfg=cfg: fused_moe(x, *c, w, ids, config=cfg)
                for c in (copies * calls)[:calls]
            ]
            timed[name] = round(time_graph(fns, ns.replays), 2)
        except Exception as exc:  # a config that does not compile, fit or match
            print(f"  {name}: {type(exc).__name__}: {str(exc)[:100]}", file=sys.stderr)
            torch.cuda.synchronize()
    return dict(sorted(timed.items(), key=lambda kv: kv[1]))


def bench(case: Case, ns: argparse.Namespace) -> dict:
    from gyrfalcon.bench.graph_timing import time_graph
    from gyrfalcon.kernels.fused_moe import fused_moe as fused_any
    from gyrfalcon.kernels.fused_moe import moe_config
    from gyrfalcon.layers.moe import moe_reference

    fused_moe = functools.partial(fused_any, routed_experts=case.routed_experts)
    x, w, ids = case.x, case.weights, case.ids
    copies = list(zip(case.w13, case.w2))
    row: dict = {"model": case.model, "tokens": case.tokens, "weight_copies": len(copies)}
    row["live_pairs"] = case.live_pairs
    pairs = case.tokens * case.top_k
    cfg = moe_config(pairs, case.routed_experts)
    row["config"] = str(cfg)
    want = moe_reference(x, case.w13[0], case.w2[0], w, ids)
    row["max_rel_err"] = rel_err(fused_moe(x, case.w13[0], case.w2[0], w, ids), want)
    row["graph_rel_err"] = check_graph_replay(case, fused_moe, moe_reference)
    row["ok"] = max(row["max_rel_err"], row["graph_rel_err"]) <= MAX_REL_ERR
    turn = itertools.count()

    def cycled(fn):
        return lambda: fn(x, *copies[next(turn) % len(copies)], w, ids)

    row["reference_us"] = time_events(cycled(moe_reference), ns.iters)
    row["fused_eager_us"] = time_events(cycled(fused_moe), ns.iters)
    calls = max(ns.iters, len(copies))
    fns = [lambda c=c: fused_moe(x, *c, w, ids) for c in (copies * calls)[:calls]]
    row["fused_graph_us"] = time_graph(fns, ns.replays)
    local_cfg = moe_config(pairs, case.local)
    if local_cfg != cfg:  # EP: the blocks the local experts' count alone would pick
        fns = [
            lambda c=c: fused_moe(x, *c, w, ids, config=local_cfg) for c in (copies * calls)[:calls]
        ]
        row["local_config"] = str(local_cfg)
        row["local_config_graph_us"] = time_graph(fns, ns.replays)
    row["speedup_graph"] = row["reference_us"] / row["fused_graph_us"]
    row["graph_gbps"] = case.routed_bytes / row["fused_graph_us"] / 1e3
    row["graph_tflops"] = case.flops() / row["fused_graph_us"] / 1e6
    if ns.sweep:
        row["sweep_us"] = sweep(case, ns, want)
        best = next(iter(row["sweep_us"].items()), None)
        print(f"  T={case.tokens} default {row['fused_graph_us']:.1f} us, best {best}")
    return row


HEADER = (
    f"{'model':<14} {'T':>5} | {'ref us':>9} {'eager us':>9} {'graph us':>9} {'x ref':>6} | "
    f"{'GB/s':>6} {'TFLOP/s':>7} | {'err':>8} {'graph err':>9}"
)


def fmt_row(r: dict) -> str:
    flag = "" if r["ok"] else "  WRONG"
    return (
        f"{r['model'][:14]:<14} {r['tokens']:>5} | {r['reference_us']:9.1f} "
        f"{r['fused_eager_us']:9.1f} {r['fused_graph_us']:9.1f} {r['speedup_graph']:6.1f} | "
        f"{r['graph_gbps']:6.0f} {r['graph_tflops']:7.1f} | {r['max_rel_err']:8.1e} "
        f"{r['graph_rel_err']:9.1e}{flag}"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda", choices=["cuda"], help="the kernel's device")
    ap.add_argument("--device-kind", default="unknown", help="recorded in the JSON")
    ap.add_argument("--model", default="qwen3-30b-a3b", choices=sorted(MODELS))
    ap.add_argument("--tokens", default="1,16,64,256,1024", help="token counts T to time")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--iters", type=int, default=20, help="calls per timed run / graph")
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument("--sweep", action="store_true", help="also time a grid of MoeConfigs")
    ap.add_argument(
        "--ep", type=int, default=1, help="time one rank's share of the experts under EP N"
    )
    ap.add_argument(
        "--tp", type=int, default=1, help="time one rank's share of the experts under MoE-TP N"
    )
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ns = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    t0 = time.monotonic()
    props = torch.cuda.get_device_properties(0)
    hidden, inter, experts, top_k = MODELS[ns.model]
    print(f"{props.name}: {ns.model} H {hidden} I {inter} E {experts} k {top_k} {ns.dtype}")
    print(HEADER, flush=True)
    rows = []
    for tokens in (int(v) for v in ns.tokens.split(",")):
        try:
            case = Case(ns.model, tokens, DTYPES[ns.dtype], seed=tokens, ep=ns.ep, tp=ns.tp)
            row = bench(case, ns)
        except Exception as exc:  # report, keep the other T
            print(f"T={tokens}: {type(exc).__name__}: {exc}", file=sys.stderr)
            torch.cuda.synchronize()
            continue
        finally:
            torch.cuda.empty_cache()
        rows.append(row)
        print(fmt_row(row), flush=True)
        if "local_config_graph_us" in row:
            local_us = row["local_config_graph_us"]
            print(f"  blocks of the local E alone: {local_us:.1f} us", flush=True)
    elapsed = time.monotonic() - t0
    print(f"total {elapsed:.0f} s")
    result = {
        "bench": "moe",
        "device_kind": ns.device_kind,
        "device_name": props.name,
        "model": ns.model,
        "shape": {"hidden": hidden, "inter": inter, "experts": experts, "top_k": top_k},
        "ep": ns.ep,
        "tp": ns.tp,
        "dtype": ns.dtype,
        "commit": git_commit(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "elapsed_s": elapsed,
        "rows": rows,
    }
    if ns.out:
        Path(ns.out).write_text(json.dumps(result, indent=2))
    return 0 if all(r["ok"] for r in rows) and rows else 1


if __name__ == "__main__":
    sys.exit(main())
