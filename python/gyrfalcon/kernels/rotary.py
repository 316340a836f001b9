"""Triton rotate-half rotary embedding, applied in place to q and k.

Numerics follow `gyrfalcon.layers.rotary.RotaryEmbedding`: cos/sin are float32
values of `float(position) * inv_freq` (precomputed into a cache with the same
torch ops), rounded to the q dtype, and `q * cos + rotate_half(q) * sin` is
evaluated with each product and the sum rounded to the q dtype, as torch does
elementwise for half-precision tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """[max_positions, D] float32 table: cos in columns [0, D/2), sin in [D/2, D).

    inv_freq: [D/2] float32 (from `rope_inv_freq`). Built with the same torch ops
    as the reference module, so row p equals its cos/sin for position p bit for bit
    (on the same device).
    """
    inv_freq = inv_freq.to(torch.float32)
    pos = torch.arange(max_positions, device=inv_freq.device, dtype=torch.int64)
    freqs = pos.to(torch.float32)[:, None] * inv_freq[None, :]  # [max_pos, D/2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).contiguous()


@triton.jit
def _rotate_heads(
    base_ptr,  # this token's row of q or k
    stride_h,
    num_heads,
    cos,  # [1, BLOCK_D] float32, already rounded through the tensor dtype
    sin,  # [1, BLOCK_D] float32, ditto
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    dtype = base_ptr.dtype.element_ty
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + offs_h
        mask = (heads[:, None] < num_heads) & (offs_d[None, :] < HALF)
        p1 = base_ptr + heads[:, None] * stride_h + offs_d[None, :]  # [BLOCK_H, BLOCK_D]
        p2 = p1 + HALF
        x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
        # out1 = x1*cos + (-x2)*sin ; out2 = x2*cos + x1*sin, every op rounded to dtype
        a1 = (x1 * cos).to(dtype).to(tl.float32)
        b1 = (-x2 * sin).to(dtype).to(tl.float32)
        a2 = (x2 * cos).to(dtype).to(tl.float32)
        b2 = (x1 * sin).to(dtype).to(tl.float32)
        tl.store(p1, (a1 + b1).to(dtype), mask=mask)
        tl.store(p2, (a2 + b2).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [T, Hq, D], last dim contiguous
    k_ptr,  # [T, Hk, D], last dim contiguous
    pos_ptr,  # [T] int32/int64
    cache_ptr,  # [max_pos, D] float32
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    s_cache,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HALF
    row = cache_ptr + pos * s_cache
    cos = tl.load(row + offs_d, mask=dmask, other=0.0)[None, :]
    sin = tl.load(row + HALF + offs_d, mask=dmask, other=0.0)[None, :]
    # NOTE: the reference rounds cos/sin to the q dtype before multiplying (q and k
    # share one dtype, asserted on the host).
    dtype = q_ptr.dtype.element_ty
    cos = cos.to(dtype).to(tl.float32)
    sin = sin.to(dtype).to(tl.float32)
    _rotate_heads(q_ptr + t * sq_t, sq_h, num_q_heads, cos, sin, HALF, BLOCK_H, BLOCK_D)
    _rotate_heads(k_ptr + t * sk_t, sk_h, num_k_heads, cos, sin, HALF, BLOCK_H, BLOCK_D)


def rotary_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply rotate-half RoPE to q [T, Hq, D] and k [T, Hk, D] in place; returns (q, k).

    q and k may be strided views (e.g. slices of a fused qkv projection reshaped
    per head) as long as the head dim is contiguous; the writes land in the
    underlying buffer. positions: [T] integer; cos_sin_cache: [max_pos, D] float32
    from `build_cos_sin_cache`. Positions are not range-checked (no host sync):
    every position must be < max_pos.
    """
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == positions.shape[0]
    assert q.shape[-1] == k.shape[-1] == cos_sin_cache.shape[-1]
    assert q.dtype == k.dtype and cos_sin_cache.dtype == torch.float32
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    head_dim = q.shape[-1]
    assert head_dim % 2 == 0
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return q, k
    half = head_dim // 2
    block_d = triton.next_power_of_2(half)
    # ~2K elements per tile keeps registers modest for D=128 (16 heads a step).
    block_h = max(1, min(triton.next_power_of_2(max(q.shape[1], k.shape[1])), 2048 // block_d))
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        q.shape[1], k.shape[1],
        HALF=half, BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return q, k
