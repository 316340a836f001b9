"""Triton rotate-half rotary embedding, applied in place to q and k.

Numerics follow `gyrfalcon.layers.rotary.RotaryEmbedding`: cos/sin are float32
values of `float(position) * inv_freq` (precomputed into a cache with the same
torch ops), rounded to the q dtype, and `q * cos + rotate_half(q) * sin` is
evaluated with each product and the sum rounded to the q dtype, as torch does
elementwise for half-precision tensors.

`rotary_and_store` also writes the rotated k and v into the paged KV cache (what
`store_kv` does), in the same launch.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from gyrfalcon.kernels.kv_store import copy_rows, to_cache

# NOTE: compiled, a plain `x * cos + xp * sin` is not the reference's: LLVM narrows the
# products to the dtype and fuses one of them with the sum (fma.rn.bf16: that product
# unrounded; which one depends on the code around, so two kernels rotating alike can
# disagree). PTX ops with an explicit rounding are never fused. (libdevice's mul_rn and
# add_rn are not either, but Triton links them flushing subnormals to zero, as torch
# does not.) The interpreter runs no PTX and rounds each op as written; like triton.jit,
# this is decided at import.
_ROUNDED_OPS = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


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
def _rotated(x, xp, cos, sin, dtype: tl.constexpr):
    """x * cos + xp * sin (float32 tensors holding `dtype` values), each product and the
    sum rounded to dtype, as torch computes it in dtype; in `dtype`."""
    if _ROUNDED_OPS:
        a = _f32_rn("mul.rn.f32 $0, $1, $2;", x, cos).to(dtype).to(tl.float32)
        b = _f32_rn("mul.rn.f32 $0, $1, $2;", xp, sin).to(dtype).to(tl.float32)
        return _f32_rn("add.rn.f32 $0, $1, $2;", a, b).to(dtype)
    else:
        a = (x * cos).to(dtype).to(tl.float32)
        b = (xp * sin).to(dtype).to(tl.float32)
        return (a + b).to(dtype)


@triton.jit
def _f32_rn(op: tl.constexpr, a, b):
    """One PTX float32 op on a and b, as written (round to nearest, subnormals kept)."""
    return tl.inline_asm_elementwise(op, "=f,f,f", [a, b], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def cos_sin_of(
    cs_row,  # a token's row of the cos/sin table (float32, cos | sin)
    dtype: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """The token's ([1, BLOCK_D] cos, [1, BLOCK_D] sin) as `rotated_heads` multiplies by
    them: column d takes frequency d mod HEAD_DIM / 2, rounded to dtype (held in
    float32); 0 past HEAD_DIM."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    freq = tl.where(offs_d < HALF, offs_d, offs_d - HALF)  # column of cos/sin
    cos = tl.load(cs_row + freq, mask=mask_d, other=0.0).to(dtype).to(tl.float32)[None, :]
    sin = tl.load(cs_row + HALF + freq, mask=mask_d, other=0.0).to(dtype).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _halves(rows, mask_r, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """(x, rotate_half(x)), float32 [R, BLOCK_D], of the rows starting at `rows` ([R, 1]
    pointers, head dim contiguous); entries masked off by mask_r ([R]) or past HEAD_DIM
    are 0."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_d = tl.arange(0, BLOCK_D)
    first = offs_d < HALF
    partner = tl.where(first, offs_d + HALF, offs_d - HALF)  # rotate_half's source
    mask = mask_r[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(rows + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    return x, tl.where(first[None, :], -xp, xp)


@triton.jit
def rotated_heads(
    base_ptr,  # one token's [heads, D] rows of q or k (head dim contiguous)
    heads,  # [BLOCK_H] head indices
    stride_h,
    mask_h,  # [BLOCK_H]
    cos,  # [1, BLOCK_D] the token's cos and sin (`cos_sin_of`, base_ptr's dtype)
    sin,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """[BLOCK_H, BLOCK_D] rows rotated (rotate-half RoPE), in base_ptr's dtype, with the
    reference's roundings: x * cos + rotate_half(x) * sin, cos/sin rounded to the
    dtype, each product and the sum rounded to it. Masked entries are 0."""
    x, xp = _halves(base_ptr + heads[:, None] * stride_h, mask_h, HEAD_DIM, BLOCK_D)
    return _rotated(x, xp, cos, sin, base_ptr.dtype.element_ty)


@triton.jit
def rotated_rows(
    row_ptrs,  # [R] each row's start (a token's head of q or k; head dim contiguous)
    mask_r,  # [R]
    cs_rows,  # [R] each row's token's row of the cos/sin table (float32, cos | sin)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """[R, BLOCK_D] rows rotated as `rotated_heads` rotates them, each row at its own
    token's position (its own cos/sin row)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = row_ptrs.dtype.element_ty
    x, xp = _halves(row_ptrs[:, None], mask_r, HEAD_DIM, BLOCK_D)
    offs_d = tl.arange(0, BLOCK_D)
    freq = tl.where(offs_d < HALF, offs_d, offs_d - HALF)  # column of cos/sin
    mask = mask_r[:, None] & (offs_d < HEAD_DIM)[None, :]
    cs = cs_rows[:, None] + freq[None, :]
    cos = tl.load(cs, mask=mask, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(cs + HALF, mask=mask, other=0.0).to(dtype).to(tl.float32)
    return _rotated(x, xp, cos, sin, dtype)


@triton.jit
def _rotate_heads(
    base_ptr,  # this token's row of q or k
    stride_h,
    num_heads,
    cs_row,  # this token's cos/sin row
    cache_ptr,  # this token's cache slot (used when STORE)
    s_cache_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STORE: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    cos, sin = cos_sin_of(cs_row, base_ptr.dtype.element_ty, HEAD_DIM, BLOCK_D)
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + offs_h
        mask_h = heads < num_heads
        out = rotated_heads(base_ptr, heads, stride_h, mask_h, cos, sin, HEAD_DIM, BLOCK_D)
        # NOTE: every element was loaded (by this thread or another) before any store
        tl.debug_barrier()
        mask = mask_h[:, None] & mask_d[None, :]
        tl.store(base_ptr + heads[:, None] * stride_h + offs_d[None, :], out, mask=mask)
        if STORE:
            c = cache_ptr + heads[:, None] * s_cache_h + offs_d[None, :]
            tl.store(c, to_cache(out, cache_ptr), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,  # [T, Hq, D], last dim contiguous
    k_ptr,  # [T, Hk, D], last dim contiguous
    pos_ptr,  # [T] int32/int64
    cache_ptr,  # [max_pos, D] float32
    v_ptr,  # [T, Hk, D] (used when STORE)
    kc_ptr,  # [S, Hk, D] layer's K cache (used when STORE)
    vc_ptr,  # [S, Hk, D] layer's V cache (used when STORE)
    loc_ptr,  # [T] slots (used when STORE)
    sq_t,
    sq_h,
    sk_t,
    sk_h,
    s_cache,
    sv_t,
    sv_h,
    skc_s,
    skc_h,
    svc_s,
    svc_h,
    num_q_heads,
    num_k_heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STORE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cs_row = cache_ptr + pos * s_cache
    q_row = q_ptr + t * sq_t
    _rotate_heads(q_row, sq_h, num_q_heads, cs_row, q_row, 0, HEAD_DIM, BLOCK_H, BLOCK_D, False)
    slot = tl.load(loc_ptr + t).to(tl.int64) if STORE else 0
    kc_row = kc_ptr + slot * skc_s
    _rotate_heads(
        k_ptr + t * sk_t, sk_h, num_k_heads, cs_row, kc_row, skc_h, HEAD_DIM, BLOCK_H, BLOCK_D,
        STORE,
    )  # fmt: skip
    if STORE:
        copy_rows(
            v_ptr + t * sv_t, vc_ptr + slot * svc_s, sv_h, svc_h, num_k_heads, HEAD_DIM,
            BLOCK_H, BLOCK_D,
        )  # fmt: skip


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
    _launch(q, k, positions, cos_sin_cache, None)
    return q, k


def rotary_and_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
) -> None:
    """`rotary_inplace(q, k, ...)`, then `store_kv(k, v, k_cache, v_cache, loc)`, in one
    launch. v: [T, Hk, D] (strided allowed); k_cache, v_cache: [S, Hk, D]; loc: [T] slots,
    not range-checked (see `store_kv` on slots shared by padded rows)."""
    assert v.shape == k.shape and v.stride(-1) == 1 and loc.shape == (k.shape[0],)
    assert k_cache.dim() == 3 and k_cache.shape[1:] == k.shape[1:]
    assert v_cache.shape == k_cache.shape
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    _launch(q, k, positions, cos_sin_cache, (v, k_cache, v_cache, loc))


ROTARY_WARPS = 4


def rotary_constexprs(head_dim: int, heads: int, store: bool) -> dict:
    """The rotary kernel's compile-time arguments for heads of head_dim (heads: the more
    of q's and k's), as `rotary_inplace` (store False) or `rotary_and_store` launch it."""
    block_d = triton.next_power_of_2(head_dim)
    # ~2K elements per tile keeps registers modest (D=128: 16 heads a step).
    block_h = max(1, min(triton.next_power_of_2(heads), 2048 // block_d))
    return dict(HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, STORE=store)


def _launch(q, k, positions, cos_sin_cache, store) -> None:
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] == positions.shape[0]
    assert q.shape[-1] == k.shape[-1] == cos_sin_cache.shape[-1]
    assert q.dtype == k.dtype and cos_sin_cache.dtype == torch.float32
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    head_dim = q.shape[-1]
    assert head_dim % 2 == 0
    num_tokens = q.shape[0]
    if num_tokens == 0:
        return
    if store is None:
        v, kc, vc, loc = k, k, k, positions  # unused (STORE=False)
    else:
        v, kc, vc, loc = store
    _rotary_kernel[(num_tokens,)](
        q, k, positions, cos_sin_cache, v, kc, vc, loc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin_cache.stride(0),
        v.stride(0), v.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
        q.shape[1], k.shape[1],
        **rotary_constexprs(head_dim, max(q.shape[1], k.shape[1]), store is not None),
        num_warps=ROTARY_WARPS,
    )  # fmt: skip
