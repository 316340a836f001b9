#!/usr/bin/env python3
"""Decode-shaped linear layers: cuBLAS vs the Triton skinny GEMM, with a config sweep.

For the Llama-3.1-8B and SmolLM2-135M projections (qkv, o, gate_up, down, and
down fused with silu_and_mul) and M in --ms rows, times
- cuBLAS: `F.linear` (fused rows: the engine's `silu_and_mul`, a Triton kernel
  on CUDA, then `F.linear`; plus pure torch `F.silu(g) * u` then `F.linear`),
- `skinny_linear` with its default config (`gemv_config`),
- for M in --sweep-ms, every candidate of a pruned config grid (fused rows: the
  best few of the plain down projection and, at M > 1, a small tensor-core
  grid; at M = 1 with --fused-grid the whole FMA grid); for other M, the default
  plus the best configs found at the swept M.
Each variant is captured in a CUDA graph of back-to-back calls (>= --reps, and
enough that the distinct weight copies the calls rotate through total >= 100 MB,
so L2 never holds the weight) and replayed; the figure is the median replay time
divided by the calls. GB/s counts weight bytes only. Every candidate's output is
checked against cuBLAS first; wrong or failing candidates are skipped. A
read-only streaming kernel gives the achievable read bandwidth for reference.

    PYTHONPATH=python python3 benchmarks/bench_gemv.py --device-kind nvidia-h100-x1 \\
        --output-json gemv.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    import gyrfalcon  # noqa: F401
except ImportError:  # running from a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from gyrfalcon.bench.graph_timing import time_graph
from gyrfalcon.bench.provenance import git_commit  # noqa: E402
from gyrfalcon.kernels.device import gpu_name  # noqa: E402
from gyrfalcon.kernels.gemv import (  # noqa: E402
    FUSED_SILU_MUL_MAX_M,
    NORM_FUSED_MAX_K,
    skinny_linear,
)
from gyrfalcon.kernels.gemv_config import GemvConfig, gemv_config  # noqa: E402

# name: (hidden, intermediate, q heads, kv heads, head dim)
MODELS = {
    "llama-3.1-8b": (4096, 14336, 32, 8, 128),
    "llama-3.1-8b-tp2": (4096, 7168, 16, 4, 128),  # one rank's share at tp 2
    "smollm2-135m": (576, 1536, 9, 3, 64),
}
ROTATE_BYTES = 100 << 20  # distinct weight bytes a graph cycles through (> L2)
TOP_FOR_FUSED = 4  # fused rows try the default + this many best plain-down configs
TOP_OTHER_M = 3  # unswept M try the default + this many best of each swept M
SUGGEST_GAIN = 0.03  # a swept best this much faster than the engine's pick is printed


def layer_shapes(model: str) -> list[tuple[str, int, int, bool]]:
    """(layer, N, K, act_silu_mul) of one decoder layer's projections."""
    hidden, inter, h, kvh, d = MODELS[model]
    return [
        ("qkv", (h + 2 * kvh) * d, hidden, False),
        ("o", hidden, h * d, False),
        ("gate_up", 2 * inter, hidden, False),
        ("down", hidden, inter, False),
        ("down_silu_mul", hidden, inter, True),
    ]


def candidate_configs(use_dot: bool) -> list[GemvConfig]:
    """The sweep grid, pruned to tiles of 8..32 (FMA) / 16..64 (dot) weight
    elements per thread, FMA steps at least a warp of 16-byte vectors wide, and
    dot pipelines (up to 6 stages) within 160 KB of shared memory."""
    out = []
    stages = (2, 3, 4, 5, 6) if use_dot else (2, 3, 4)
    grid = itertools.product((4, 8, 16, 32, 64), (128, 256, 512, 1024), (2, 4, 8), stages)
    for bn, bk, nw, ns in grid:
        per_thread = bn * bk // (32 * nw)
        if use_dot:
            if bn < 16 or not 16 <= per_thread <= 64 or ns * (bn + 16) * bk * 2 > 160 << 10:
                continue
        elif bk < 256 or not 8 <= per_thread <= 32:
            continue
        out.append(GemvConfig(bn, bk, nw, ns, use_dot=use_dot))
    return out


def fused_dot_configs() -> list[GemvConfig]:
    """Tensor-core candidates for the fused silu_mul rows (swept at M > 1)."""
    grid = itertools.product((16, 32, 64), (128, 256), (4, 8), (3, 4))
    return [GemvConfig(bn, bk, nw, ns, use_dot=True) for bn, bk, nw, ns in grid]


def cfg_name(cfg: GemvConfig) -> str:
    path = "dot" if cfg.use_dot else "fma"
    return f"{path}/n{cfg.block_n}/k{cfg.block_k}/w{cfg.num_warps}/s{cfg.num_stages}"


@triton.jit
def _read_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(dst_ptr + pid, tl.sum(tl.load(src_ptr + offs).to(tl.float32)))


def read_bandwidth_gbps(replays: int) -> float:
    """Best GB/s of a kernel that only streams 1 GiB of bf16 (reduced per block)."""
    src = torch.randn(1 << 29, dtype=torch.bfloat16, device="cuda")
    best = 0.0
    for block, nw in ((4096, 4), (8192, 8), (16384, 8)):
        dst = torch.empty(src.numel() // block, dtype=torch.float32, device="cuda")

        def fn(dst=dst, block=block, nw=nw):
            _read_kernel[(dst.numel(),)](src, dst, BLOCK=block, num_warps=nw)

        fn()
        us = time_graph([fn] * 3, replays)
        best = max(best, src.numel() * 2 / us / 1e3)
    return best


class Case:
    """One (model, layer, M): inputs, weight copies, the cuBLAS reference."""

    def __init__(self, model: str, layer: str, n: int, k: int, act: bool, m: int, reps: int):
        dev, dt = torch.device("cuda"), torch.bfloat16
        self.model, self.layer, self.n, self.k, self.act, self.m = model, layer, n, k, act, m
        self.w_bytes = n * k * 2
        copies = max(1, -(-ROTATE_BYTES // self.w_bytes))
        gen = torch.Generator(device=dev).manual_seed(n * 7 + k)
        w0 = (torch.randn(n, k, device=dev, dtype=dt, generator=gen) * 0.02).contiguous()
        self.ws = [w0] + [w0.roll(i, dims=0).contiguous() for i in range(1, copies)]
        self.x = torch.randn(m, 2 * k if act else k, device=dev, dtype=dt, generator=gen)
        self.calls = max(reps, copies)

    def fns(self, one: Callable[[torch.Tensor], object]) -> list[Callable[[], object]]:
        ws = [self.ws[i % len(self.ws)] for i in range(self.calls)]
        return [lambda w=w: one(w) for w in ws]

    def gbps(self, us: float) -> float:
        return self.w_bytes / us / 1e3


def engine_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    from gyrfalcon.kernels.dispatch import DEFAULT_KERNELS
    from gyrfalcon.layers.activation import silu_and_mul

    return silu_and_mul(x, DEFAULT_KERNELS)


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def try_config(case: Case, cfg: GemvConfig | None, ref: torch.Tensor, replays: int) -> float:
    """us per call of skinny_linear with cfg (None: default), or raises if wrong."""
    x, act = case.x, case.act
    out = skinny_linear(x, case.ws[0], config=cfg, act_silu_mul=act)
    torch.cuda.synchronize()
    err = (out.float() - ref.float()).abs().max().item()
    tol = 2**-6 * ref.float().abs().max().item() + 1e-3
    if not err <= tol:
        raise AssertionError(f"max error {err:.4g} > {tol:.4g}")
    return time_graph(
        case.fns(lambda w: skinny_linear(x, w, config=cfg, act_silu_mul=act)), replays
    )


def bench_case(
    case: Case, candidates: list[GemvConfig], ns: argparse.Namespace, num_sms: int
) -> tuple[dict, list[tuple[float, GemvConfig]]]:
    x, m, n, k = case.x, case.m, case.n, case.k
    row: dict = {
        "model": case.model, "layer": case.layer, "m": m, "n": n, "k": k,
        "act_silu_mul": case.act, "weight_bytes": case.w_bytes,
        "weight_copies": len(case.ws), "calls_per_graph": case.calls,
    }  # fmt: skip
    if case.act:
        ref = F.linear(engine_silu_and_mul(x), case.ws[0])
        cublas = lambda w: F.linear(engine_silu_and_mul(x), w)
        row["torch_unfused_us"] = time_graph(
            case.fns(lambda w: F.linear(torch_silu_and_mul(x), w)), ns.replays
        )
    else:
        ref = F.linear(x, case.ws[0])
        cublas = lambda w: F.linear(x, w)
    row["cublas_us"] = time_graph(case.fns(cublas), ns.replays)
    row["cublas_gbps"] = case.gbps(row["cublas_us"])
    # NOTE: what the engine picks on this GPU (its tuned table by name included)
    gpu = gpu_name(case.x.device)
    default = gemv_config(m, n, k, num_sms, act_silu_mul=case.act, gpu=gpu)
    row["default_config"] = cfg_name(default)
    try:
        row["default_us"] = try_config(case, None, ref, ns.replays)
        row["default_gbps"] = case.gbps(row["default_us"])
    except Exception as exc:  # report, keep going
        row["default_us"] = row["default_gbps"] = float("nan")
        row["default_error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(f"  default {cfg_name(default)} failed: {row['default_error']}", file=sys.stderr)
    results: list[tuple[float, GemvConfig]] = []
    if row["default_us"] == row["default_us"]:
        results.append((row["default_us"], default))
    failed = []
    for cfg in dict.fromkeys(candidates):
        if cfg == default:
            continue
        try:
            results.append((try_config(case, cfg, ref, ns.replays), cfg))
        except Exception as exc:  # a config that does not compile, fit or match
            failed.append(f"{cfg_name(cfg)}: {type(exc).__name__}: {str(exc)[:120]}")
            torch.cuda.synchronize()
    results.sort(key=lambda r: r[0])
    row["candidates_timed"] = len(results)
    row["candidates_failed"] = failed[:20]
    if results:
        best_us, best = results[0]
        row.update(best_config=cfg_name(best), best_us=best_us, best_gbps=case.gbps(best_us))
        row["top"] = [[cfg_name(c), round(us, 2)] for us, c in results[:5]]
        row["all"] = {cfg_name(c): round(us, 3) for us, c in results}
    if case.act and results:  # what the fusion buys over silu_and_mul + skinny_linear
        plain = gemv_config(m, n, k, num_sms, gpu=gpu)
        row["skinny_unfused_us"] = time_graph(
            case.fns(lambda w: skinny_linear(engine_silu_and_mul(x), w, config=plain)),
            ns.replays,
        )
    return row, results


def runs_in_engine(layer: str, m: int, k: int) -> bool:
    """Whether the model runs this layer at m rows through `skinny_linear` with its
    default config: the fused down only where it replaces the plain one (m <=
    FUSED_SILU_MUL_MAX_M), and not qkv and gate_up where add+RMSNorm folds into them
    (`norm_skinny_linear`, its own kernel)."""
    if layer in ("down", "down_silu_mul"):
        return (m <= FUSED_SILU_MUL_MAX_M) == (layer == "down_silu_mul")
    return not (layer in ("qkv", "gate_up") and m == 1 and k <= NORM_FUSED_MAX_K)


def suggestions(rows: list[dict]) -> list[str]:
    """`_TUNED_BY_GPU` table lines, `(n, k, act_silu_mul, m == 1): GemvConfig(...)`, for
    each swept row whose best beats the engine's pick by more than SUGGEST_GAIN (one line
    per row: rows of m > 1 share a key, so read them together before adding one)."""
    out = []
    for r in rows:
        best, default = r.get("best_us"), r.get("default_us")
        if not r.get("swept") or best is None or not best < (1 - SUGGEST_GAIN) * default:
            continue
        if not runs_in_engine(r["layer"], r["m"], r["k"]):
            continue
        path, bn, bk, nw, ns = r["best_config"].replace("/", " ").split()
        cfg = (
            f"GemvConfig({bn[1:]}, {bk[1:]}, num_warps={nw[1:]}, num_stages={ns[1:]}, "
            f"use_dot={path == 'dot'})"
        )
        key = f"({r['n']}, {r['k']}, {r['act_silu_mul']}, {r['m'] == 1})"
        note = f"{r['model']} {r['layer']} m={r['m']}: {default:.2f} -> {best:.2f} us"
        out.append(f"    {key}: {cfg},  # {note}")
    return out


def fmt_row(r: dict, read_gbps: float) -> str:
    def cell(us_key: str, gb_key: str) -> str:
        us = r.get(us_key, float("nan"))
        gb = r.get(gb_key, float("nan"))
        return f"{us:8.2f} {gb:6.0f} {100 * gb / read_gbps:4.0f}%"

    name = f"{r['model'][:5]}/{r['layer']}"
    return (
        f"{name:<20} {r['m']:>2} {r['weight_bytes'] / 1e6:7.2f} | "
        f"{cell('cublas_us', 'cublas_gbps')} | {cell('default_us', 'default_gbps')} | "
        f"{cell('best_us', 'best_gbps')} {r.get('best_config', '-')}"
    )


HEADER = (
    f"{'shape':<20} {'M':>2} {'W MB':>7} | {'cuBLAS us':>8} {'GB/s':>6} {'read':>5} | "
    f"{'default':>8} {'GB/s':>6} {'read':>5} | {'best us':>8} {'GB/s':>6} {'read':>5} config"
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ms", default="1,2,4,8,16", help="row counts M to time")
    ap.add_argument("--sweep-ms", default="1,8", help="M at which the config grid is swept")
    ap.add_argument("--reps", type=int, default=20, help="min calls per captured graph")
    ap.add_argument("--replays", type=int, default=7)
    ap.add_argument(
        "--time-budget", type=float, default=120.0,
        help="seconds; past it, remaining sweeps shrink to the best configs found so far",
    )  # fmt: skip
    ap.add_argument(
        "--fused-grid", action="store_true",
        help="sweep the fused down projection at M = 1 over the whole FMA grid (its "
        "activation, recomputed by every program, can favour other tiles than the plain down)",
    )  # fmt: skip
    ns = ap.parse_args(argv)
    t0 = time.monotonic()
    ms = [int(v) for v in ns.ms.split(",")]
    sweep_ms = {int(v) for v in ns.sweep_ms.split(",")}
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    read_gbps = read_bandwidth_gbps(ns.replays)
    torch.cuda.empty_cache()
    print(f"{props.name}: {num_sms} SMs, read bandwidth {read_gbps:.0f} GB/s", flush=True)
    grid = {True: candidate_configs(True), False: candidate_configs(False)}
    rows = []
    # (model, layer, m) -> sorted [(us, cfg)], to seed the fused and unswept rows
    found: dict[tuple[str, str, int], list[tuple[float, GemvConfig]]] = {}
    for model in ns.models.split(","):
        for layer, n, k, act in layer_shapes(model):
            for m in sorted(ms, key=lambda v: (v not in sweep_ms, v)):
                over = time.monotonic() - t0 > ns.time_budget
                swept = m in sweep_ms and not over
                if act and swept and m == 1 and ns.fused_grid:  # every FMA candidate
                    cands = grid[False]
                elif act and swept:  # the best plain-down configs, and a dot grid
                    plain = found.get((model, "down", m), [])
                    cands = [c for _, c in plain[:TOP_FOR_FUSED]]
                    cands += fused_dot_configs() if m > 1 else []
                elif swept:
                    cands = grid[True] + (grid[False] if m == 1 else [])
                else:  # the best of the swept M of this shape (FMA only for M <= 4)
                    cands = []
                    for sm in sorted(sweep_ms):
                        cands += [c for _, c in found.get((model, layer, sm), [])[:TOP_OTHER_M]]
                    cands = [c for c in dict.fromkeys(cands) if c.use_dot or m <= 4]
                try:
                    case = Case(model, layer, n, k, act, m, ns.reps)
                    row, results = bench_case(case, cands, ns, num_sms)
                except Exception as exc:  # keep the other shapes
                    print(f"{model}/{layer} M={m}: {type(exc).__name__}: {exc}", file=sys.stderr)
                    torch.cuda.synchronize()
                    continue
                finally:
                    case = None
                    torch.cuda.empty_cache()
                row["swept"] = swept
                found[(model, layer, m)] = results
                rows.append(row)
                print(fmt_row(row, read_gbps), f"[{time.monotonic() - t0:.0f}s]", flush=True)
    print()
    print(f"read bandwidth {read_gbps:.0f} GB/s; 'read' = % of it")
    print(HEADER)
    for r in rows:
        print(fmt_row(r, read_gbps))
    for r in rows:
        if r["act_silu_mul"]:
            print(
                f"{r['model']} fused down M={r['m']}: torch silu*u + linear "
                f"{r.get('torch_unfused_us', float('nan')):.2f} us, engine silu_and_mul + "
                f"linear {r['cublas_us']:.2f} us, silu_and_mul + skinny "
                f"{r.get('skinny_unfused_us', float('nan')):.2f} us, fused skinny "
                f"{r.get('best_us', float('nan')):.2f} us"
            )
    elapsed = time.monotonic() - t0
    print(f"total {elapsed:.0f} s")
    suggested = suggestions(rows)
    if suggested:
        print(f"swept bests that beat the engine's pick by more than {SUGGEST_GAIN:.0%}")
        print(f"(entries for a table of {props.name!r} in kernels/gemv_config.py's _TUNED_BY_GPU):")
        print("\n".join(suggested))
    result = {
        "bench": "gemv",
        "device_kind": ns.device_kind,
        "device_name": props.name,
        "num_sms": num_sms,
        "commit": git_commit(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "read_gbps": read_gbps,
        "elapsed_s": elapsed,
        "rows": rows,
    }
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
