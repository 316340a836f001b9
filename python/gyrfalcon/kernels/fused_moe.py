"""Fused mixture-of-experts: the routed experts' weighted sum in four to six launches,
none of which asks the host anything (CUDA-graph safe: every grid and buffer is sized
from the shapes T, k, E, H, I alone; a replayed graph follows new ids).

    out[t] = sum_j  round(w[t, j] * down_e(silu(gate_e x_t) * up_e x_t)),  e = ids[t, j]

over the P = T k (token, slot) pairs ("pairs": pair p = t k + j), skipping pairs whose
id lies outside [0, E) (other ranks' experts under EP). The contract, roundings
included, is `layers.moe.moe_reference`'s.

Layout (the "align" step, `kernels/moe_align.py`): the pairs grouped by expert into
segments padded to a multiple of BLOCK_M rows, so that a block of BLOCK_M rows belongs
to one expert; grids are sized by the shape-only bound `max_blocks`.

Experts (two grouped GEMMs, float32 accumulation with tl.dot; grid (max_blocks, N
tiles)): `_gate_up_kernel` gathers x rows t = p // k of block b and computes
inter[row] = silu(gate) * up from w13[e] (both halves' tiles share the x tile; the
epilogue rounds as the reference does); `_down_kernel` computes
inter[row] @ w2[e]^T, rounds it, multiplies by w[p] in float32 and writes the
(token, slot) row ys[p] in x's dtype. `_sum_kernel` adds each token's k valid rows in
float32 and rounds once (deterministic: no atomics). Every kernel opens with the PDL
gate (`kernels/pdl.py`).

Measured on an H100 (bf16, in CUDA graphs, weights not in L2; benchmarks/bench_moe.py):
Qwen3-30B-A3B experts (H 2048, I 768, E 128, k 8) take 40 us at T 1 (75 MB of routed
weights, 1.9 TB/s; 5 us of it the align step), 277 us at T 16 (2.8 TB/s) and 571 us at
T 1024 (135 TFLOP/s); Mixtral-8x7B's (H 4096, I 14336, E 8, k 2) 254 us at T 1 (2.8
TB/s) and 1.9 ms at T 1024 (376 TFLOP/s). The reference: 2.2-42 ms and 0.65-3.1 ms.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gyrfalcon.kernels.device import launch_pdl
from gyrfalcon.kernels.gemv import silu_mul_rounded
from gyrfalcon.kernels.moe_align import align_tile, moe_align
from gyrfalcon.kernels.pdl import pdl_gate

# tl.dot needs every operand dimension >= 16 on the GPU.
_DOT_MIN = 16


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # (token, slot) rows per block: expert segments pad to a multiple of it
    block_n: int  # output columns per program (of I in gate_up, of H in down)
    block_k: int  # reduction elements per K step
    num_warps: int
    num_stages: int  # software-pipelining depth of the K loop

    def __post_init__(self) -> None:
        for v in (self.block_m, self.block_n, self.block_k, self.num_warps):
            assert v >= 1 and v & (v - 1) == 0, self
        assert min(self.block_m, self.block_n, self.block_k) >= _DOT_MIN, self
        assert self.num_stages >= 1, self


@functools.lru_cache(maxsize=1024)
def moe_config(num_pairs: int, num_experts: int, itemsize: int = 2) -> MoeConfig:
    """Default blocks for P = num_pairs (token, slot) pairs over E experts, elements of
    `itemsize` bytes (tuned for bf16; wider elements take narrower K steps, so that a
    pipeline stage holds the same bytes).

    BLOCK_M follows the mean rows per expert P / E (every segment pads to it): <= 16
    rows (decode, memory bound) 16 x 64 tiles, K steps of 128, 4 stages; <= 32 rows
    BLOCK_M 32; <= 128 rows 64 x 64 tiles, K steps of 64, 3 stages; more 128 x 128
    over 8 warps. From CUDA-graph sweeps on an H100 (benchmarks/bench_moe.py --sweep)
    of Qwen3-30B-A3B (E 128, k 8; T 1..1024) and Mixtral-8x7B (E 8, k 2; T 1..1024):
    within 5% of the best swept config at every swept T (Mixtral T 1024: 1932 us, vs
    2291 with 64 x 128 tiles; Qwen3 T 1024: 571 us, vs 641 with BLOCK_M 32)."""
    assert num_pairs >= 1 and num_experts >= 1 and itemsize in (2, 4)
    rows = num_pairs / num_experts
    cfg = next(c for most, c in _CONFIGS if most is None or rows <= most)
    return dataclasses.replace(cfg, block_k=max(_DOT_MIN, cfg.block_k * 2 // itemsize))


# `moe_config`'s classes: (the most mean rows per expert it serves, None: any, its config)
_CONFIGS: tuple[tuple[int | None, MoeConfig], ...] = (
    (16, MoeConfig(16, 64, 128, num_warps=4, num_stages=4)),
    (32, MoeConfig(32, 64, 128, num_warps=4, num_stages=4)),
    (128, MoeConfig(64, 64, 64, num_warps=4, num_stages=3)),
    (None, MoeConfig(128, 128, 64, num_warps=8, num_stages=3)),
)


def warm_up_token_counts(
    num_experts: int, top_k: int, max_tokens: int, routed_experts: int | None = None
) -> list[int]:
    """Token counts T <= max_tokens whose `fused_moe` launches (E experts, top-k; the
    pairs routed over `routed_experts`, default E) build every kernel variant any T <=
    max_tokens would: each `moe_config` class (by the mean rows P / routed_experts, P =
    T k) at its fewest and most tokens, and at both sides of the switch between the
    align paths (one chunk of `align_tile(E)` rows, or several) inside it; the last
    class, unbounded, at its fewest and past the switch only."""
    routed = routed_experts or num_experts
    switch = align_tile(num_experts)[1] // top_k  # the most T whose P fits one chunk
    out: set[int] = set()
    fewer = 0  # the rows the classes before serve
    for most, _ in _CONFIGS:
        lo = fewer * routed // top_k + 1  # the fewest T with T k / routed > fewer
        hi = max(lo, switch + 1) if most is None else most * routed // top_k
        hi = min(hi, max_tokens)
        out.update(t for t in (lo, hi, switch, switch + 1) if lo <= t <= hi)
        fewer = most or 0
    return sorted(out)


@triton.jit
def _dot_wt(a, w, acc, DOT_F32: tl.constexpr):
    """acc + a @ w^T (a [M, K], w [N, K]); exact float32 products when DOT_F32."""
    if DOT_F32:
        acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, tl.trans(w), acc)
    return acc


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr, w13_ptr, inter_ptr, sorted_pair_ptr, block_expert_ptr, num_pairs, num_experts,
    inter_size, hidden, s_x, TOP_K: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """inter [max_blocks BLOCK_M, I] = silu(gate) * up of x [T, H] (row stride s_x) rows
    t = p // k, through w13 [E, 2I, H] (contiguous) of the block's expert."""
    pdl_gate(PDL)
    block = tl.program_id(0)
    e = tl.load(block_expert_ptr + block)
    if e >= num_experts:  # past the live blocks
        return
    offs_r = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ptr + offs_r)
    live = pair < num_pairs  # not a padding row
    tok = (pair // TOP_K).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Columns past I re-read row I-1 (in bounds, never stored): weights mask K only.
    w_rows = tl.minimum(offs_n, inter_size - 1).to(tl.int64)
    w_base = w13_ptr + e.to(tl.int64) * 2 * inter_size * hidden
    wg_ptrs = w_base + w_rows[:, None] * hidden + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    wu_ptrs = w_base + (w_rows + inter_size)[:, None] * hidden + offs_k[None, :]
    x_ptrs = x_ptr + tok[:, None] * s_x + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = offs_k[None, :] < hidden - k0
        a = tl.load(x_ptrs, mask=live[:, None] & k_mask, other=0.0)
        acc_g = _dot_wt(a, tl.load(wg_ptrs, mask=k_mask, other=0.0), acc_g, DOT_F32)
        acc_u = _dot_wt(a, tl.load(wu_ptrs, mask=k_mask, other=0.0), acc_u, DOT_F32)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    dtype = x_ptr.dtype.element_ty
    h = silu_mul_rounded(acc_g.to(dtype), acc_u.to(dtype), dtype)  # gate_up rounded, as F.linear
    out_ptrs = inter_ptr + offs_r.to(tl.int64)[:, None] * inter_size + offs_n[None, :]
    tl.store(out_ptrs, h, mask=offs_n[None, :] < inter_size)


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    inter_ptr, w2_ptr, ys_ptr, weights_ptr, sorted_pair_ptr, block_expert_ptr, num_pairs,
    num_experts, hidden, inter_size, DOT_F32: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """ys[p] [P, H] = round(w[p] * round(inter[row(p)] @ w2[e]^T)) for the live pairs
    (w2 [E, H, I] contiguous; weights [P] float32 or x's dtype)."""
    pdl_gate(PDL)
    block = tl.program_id(0)
    e = tl.load(block_expert_ptr + block)
    if e >= num_experts:
        return
    offs_r = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ptr + offs_r)
    live = pair < num_pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    w_rows = tl.minimum(offs_n, hidden - 1).to(tl.int64)
    w_base = w2_ptr + e.to(tl.int64) * hidden * inter_size
    w_ptrs = w_base + w_rows[:, None] * inter_size + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    a_ptrs = inter_ptr + offs_r.to(tl.int64)[:, None] * inter_size + offs_k[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k_mask = offs_k[None, :] < inter_size - k0
        a = tl.load(a_ptrs, mask=k_mask, other=0.0)
        acc = _dot_wt(a, tl.load(w_ptrs, mask=k_mask, other=0.0), acc, DOT_F32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    dtype = inter_ptr.dtype.element_ty
    wt = tl.load(weights_ptr + pair, mask=live, other=0.0).to(tl.float32)
    y = (acc.to(dtype).to(tl.float32) * wt[:, None]).to(dtype)  # down rounded, then scaled
    ys_ptrs = ys_ptr + pair.to(tl.int64)[:, None] * hidden + offs_n[None, :]
    tl.store(ys_ptrs, y, mask=live[:, None] & (offs_n[None, :] < hidden))


@triton.jit
def _sum_kernel(
    ys_ptr, ids_ptr, out_ptr, num_experts, hidden, s_out,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """out[t] [T, H] = sum of ys[t k + j] [T k, H] over the valid slots j, in float32."""
    pdl_gate(PDL)
    tok = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < hidden
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + tok * TOP_K + j)
        if (e >= 0) & (e < num_experts):  # skipped slots' rows were never written
            y = tl.load(ys_ptr + (tok * TOP_K + j) * hidden + offs_h, mask=h_mask, other=0.0)
            acc += y.to(tl.float32)
    tl.store(out_ptr + tok * s_out + offs_h, acc.to(out_ptr.dtype.element_ty), mask=h_mask)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    config: MoeConfig | None = None,
    routed_experts: int | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """`moe_reference`'s weighted expert sum, on the device, without a host sync.

    x [T, H] (bf16 / fp16 / fp32, last dim contiguous); w13 [E, 2I, H] (gate rows then
    up rows) and w2 [E, H, I], contiguous, x's dtype; topk_weights [T, k] (float32 or
    x's dtype); topk_ids [T, k] integer, ids outside [0, E) skipped. Returns [T, H] in
    x's dtype. config: None picks `moe_config(T k, routed_experts, x.element_size())`:
    routed_experts is how many experts the pairs are routed over (default E; under EP
    every rank's, of which this call holds E, so that its blocks fit the rows each of its
    experts gets: T k / routed_experts on average, not T k / E). pdl: may launch with
    programmatic dependent launch (where the device supports it).
    """
    assert x.dim() == 2 and x.stride(-1) == 1, x.shape
    assert w13.dim() == 3 and w2.dim() == 3 and w13.is_contiguous() and w2.is_contiguous()
    num_tokens, hidden = x.shape
    num_experts, inter = w2.shape[0], w2.shape[2]
    assert w13.shape == (num_experts, 2 * inter, hidden), (w13.shape, w2.shape, x.shape)
    assert w2.shape[1] == hidden and x.dtype == w13.dtype == w2.dtype, (w2.shape, x.dtype)
    assert topk_ids.dim() == 2 and topk_ids.shape[0] == num_tokens, topk_ids.shape
    assert topk_weights.shape == topk_ids.shape, (topk_weights.shape, topk_ids.shape)
    assert not topk_ids.is_floating_point() and not topk_ids.is_complex(), topk_ids.dtype
    assert topk_weights.dtype in (torch.float32, x.dtype), topk_weights.dtype
    top_k, dev = topk_ids.shape[1], x.device
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=dev)
    num_pairs = num_tokens * top_k
    if num_pairs == 0 or hidden == 0:
        return out
    if inter == 0:
        return out.zero_()
    routed = routed_experts or num_experts
    cfg = config if config is not None else moe_config(num_pairs, routed, x.element_size())
    launch = launch_pdl(x, pdl)
    # NOTE: contiguous copies of strided views (a [T, k] slice of a wider top-k, say)
    ids, weights = topk_ids.reshape(-1).contiguous(), topk_weights.reshape(-1).contiguous()
    layout = moe_align(ids, num_experts, cfg.block_m, launch)
    blocks = layout.block_expert.numel()
    # NOTE: the interpreter (CPU tensors) multiplies bfloat16 dot operands as their raw
    # bits, so off the GPU the dots upcast to float32 (bf16 products are exact there)
    dot_f32 = x.dtype == torch.float32 or not x.is_cuda
    gemm = dict(
        DOT_F32=dot_f32, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, PDL=launch, launch_pdl=launch,
    )  # fmt: skip
    inter_rows = torch.empty(blocks * cfg.block_m, inter, dtype=x.dtype, device=dev)
    _gate_up_kernel[(blocks, triton.cdiv(inter, cfg.block_n))](
        x, w13, inter_rows, layout.sorted_pair, layout.block_expert, num_pairs, num_experts,
        inter, hidden, x.stride(0), TOP_K=top_k, **gemm,
    )  # fmt: skip
    ys = torch.empty(num_pairs, hidden, dtype=x.dtype, device=dev)  # [T k, H]
    _down_kernel[(blocks, triton.cdiv(hidden, cfg.block_n))](
        inter_rows, w2, ys, weights, layout.sorted_pair, layout.block_expert,
        num_pairs, num_experts, hidden, inter, **gemm,
    )  # fmt: skip
    block_h = min(1024, triton.next_power_of_2(hidden))
    _sum_kernel[(num_tokens, triton.cdiv(hidden, block_h))](
        ys, ids, out, num_experts, hidden, out.stride(0), TOP_K=top_k,
        BLOCK_H=block_h, num_warps=4, PDL=launch, launch_pdl=launch,
    )  # fmt: skip
    return out
