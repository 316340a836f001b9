#!/usr/bin/env python3
"""Decode attention kernel time per layer, by variant, as replayed in a CUDA graph.

Variants: flashinfer decode with and without tensor cores, each with the
planner's split-KV choice and with split-KV disabled, and our Triton split-KV
decode, by split count, alone and as the model runs it on decode batches (RoPE
and the new token's K/V write in the same launch: `triton_rope_splits*`).
For each (heads, kv heads, head dim) and batch size, every row has
--context tokens of KV on random pages; each variant is captured in a graph of
--reps calls and replayed; the figure is the median time of one call.
A small model's KV of one layer fits the L2 cache (SmolLM2 at batch 32: 25 MB of
H200's 50), so a graph calling one cache over and over reads it from L2, which no
served step does: `--cold-kv-bytes B` gives the calls as many caches (copies of the
first, read through the same page table) as hold B bytes together, taken in turn as the
layers are.

    python benchmarks/bench_attention.py --output-json attention.json --device-kind h100
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch

try:
    import gyrfalcon  # noqa: F401
except ImportError:  # running from a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from gyrfalcon.bench.graph_timing import time_graph
from gyrfalcon.bench.provenance import git_commit
from gyrfalcon.kernels.attention_decode import decode_attention
from gyrfalcon.kernels.attention_launch import DecodeRope, alloc_decode_scratch
from gyrfalcon.kernels.rotary import build_cos_sin_cache
from gyrfalcon.layers.rotary import rope_inv_freq

SHAPES = {"llama-3.1-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}


# --sweep: launch parameters of the Triton decode kernel (block_n, num_warps, num_stages)
SWEEP = list(itertools.product((32, 64, 128, 256), (2, 4, 8), (2, 3, 4)))


def bench_shape(name: str, bs: int, ns: argparse.Namespace) -> dict[str, float]:
    h, kvh, d = SHAPES[name]
    ps, ctx, dev, dt = ns.page_size, ns.context, torch.device("cuda"), torch.bfloat16
    fp8 = ns.kv_cache_dtype == "fp8_e4m3"
    kv_dt = torch.float8_e4m3fn if fp8 else dt
    pages_per_row = -(-ctx // ps)
    num_pages = bs * pages_per_row + 1
    k = torch.randn(num_pages, ps, kvh, d, dtype=dt, device=dev).to(kv_dt)
    v = torch.randn(num_pages, ps, kvh, d, dtype=dt, device=dev).to(kv_dt)
    copies = max(1, -(-ns.cold_kv_bytes // (2 * k.numel() * k.element_size())))
    caches = [(k, v)] + [(torch.empty_like(k), torch.empty_like(v)) for _ in range(copies - 1)]
    for kc_, vc_ in caches[1:]:
        kc_.copy_(k)
        vc_.copy_(v)
    reps = max(ns.reps, len(caches))
    perm = torch.randperm(num_pages - 1, device=dev)[: bs * pages_per_row] + 1
    table = perm.view(bs, pages_per_row)
    q = torch.randn(bs, h, d, dtype=dt, device=dev)
    indptr = torch.arange(0, bs + 1, dtype=torch.int32) * pages_per_row
    last = torch.full((bs,), ctx - (pages_per_row - 1) * ps, dtype=torch.int32)
    indices = table.reshape(-1).to(torch.int32)
    out: dict[str, float] = {}
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    for tc in (False, True) if not (ns.triton_only or fp8) else ():
        import flashinfer

        for split in ("auto", "off"):
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                ws,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=tc,
                paged_kv_indptr_buffer=torch.empty(bs + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.empty(indices.numel(), dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.empty(bs, dtype=torch.int32, device=dev),
            )
            try:
                w.plan(
                    indptr, indices, last, h, kvh, d, ps, q_data_type=dt, kv_data_type=dt,
                    disable_split_kv=split == "off",
                )  # fmt: skip
                out[f"flashinfer_{'tc' if tc else 'cc'}_split_{split}"] = time_graph(
                    [functools.partial(w.run, q, caches[i % len(caches)]) for i in range(reps)],
                    5,
                )
            except Exception as exc:  # a variant flashinfer does not offer here
                out[f"flashinfer_{'tc' if tc else 'cc'}_split_{split}"] = float("nan")
                print(f"{name} bs {bs} tc={tc} split={split}: {exc}", file=sys.stderr)
    seq = torch.full((bs,), ctx, dtype=torch.int32, device=dev)
    o = torch.empty_like(q)
    # the new token (position ctx - 1) of each row, for the fused RoPE + K/V write
    cos_sin = build_cos_sin_cache(rope_inv_freq(d, 500000.0, None).to(dev), ctx)
    last_slot = table[:, (ctx - 1) // ps].to(torch.int64) * ps + (ctx - 1) % ps
    new_k, new_v = (torch.randn(bs, kvh, d, dtype=dt, device=dev) for _ in range(2))
    rope = DecodeRope(new_k, new_v, seq.to(torch.int64) - 1, cos_sin, last_slot)
    flat = [(kc_.view(-1, kvh, d), vc_.view(-1, kvh, d)) for kc_, vc_ in caches]

    def calls(**kw) -> list:
        """reps calls, call i on cache i % copies."""
        return [
            functools.partial(decode_attention, q, *flat[i % len(flat)], table, seq, o, **kw)
            for i in range(reps)
        ]

    for splits in [int(x) for x in ns.splits.split(",")]:
        scratch = alloc_decode_scratch(bs, h, d, splits, dev)
        for tag, r in (("triton", None), ("triton_rope", rope)):
            fns = calls(scratch=scratch, page_size=ps, scale=d**-0.5, rope=r)
            out[f"{tag}_splits{splits}"] = time_graph(fns, 5)
        if not ns.sweep:
            continue
        for bn, warps, stages in SWEEP:
            fns = calls(
                scratch=scratch, page_size=ps, scale=d**-0.5, block_n=bn, rope=rope,
                num_warps=warps, num_stages=stages,
            )  # fmt: skip
            tag = f"triton_rope_splits{splits}_n{bn}_w{warps}_s{stages}"
            try:
                out[tag] = time_graph(fns, 5)
            except Exception as exc:  # e.g. more shared memory than the device has
                out[tag] = float("nan")
                print(f"{name} bs {bs} {tag}: {str(exc).splitlines()[0]}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch-sizes", default="1,8,32,64,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--device-kind", default="unknown")
    ap.add_argument("--output-json", default=None)
    ap.add_argument("--triton-only", action="store_true", help="skip the flashinfer variants")
    ap.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"], help="fp8: Triton only"
    )
    ap.add_argument("--splits", default="1,2,4,8,16", help="split counts of the Triton kernel")
    ap.add_argument(
        "--cold-kv-bytes",
        type=int,
        default=0,
        help="KV caches taken in turn, this many bytes together (0: one; module docstring)",
    )
    ap.add_argument("--shapes", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="also time the fused decode per (block_n, num_warps, num_stages)",
    )
    ns = ap.parse_args(argv)
    rows = []
    for name in ns.shapes.split(","):
        for bs in (int(x) for x in ns.batch_sizes.split(",")):
            t = bench_shape(name, bs, ns)
            rows.append({"shape": name, "batch_size": bs, "context": ns.context, "us": t})
            best = min((v, k) for k, v in t.items() if v == v)
            print(f"{name:>13} bs {bs:>3}: " + "  ".join(f"{k} {v:.1f}" for k, v in t.items()))
            print(f"{'':>13} best: {best[1]} {best[0]:.1f} us", flush=True)
    result = {
        "bench": "decode_attention",
        "device_kind": ns.device_kind,
        "model": ",".join(SHAPES),
        "commit": git_commit(),
        "device_name": torch.cuda.get_device_name(),
        "page_size": ns.page_size,
        "kv_cache_dtype": ns.kv_cache_dtype,
        "cold_kv_bytes": ns.cold_kv_bytes,
        "rows": rows,
    }
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
