"""Triton scatter of new K/V rows into the paged KV cache.

`store_kv` is the kernel twin of `KVCache.write` (an `index_copy_` per tensor):
row t of k/v lands in slot loc[t] of the layer's cache, cast to the cache dtype
(saturating at +-448 for an fp8 e4m3 cache, as `to_cache_dtype`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def to_cache(vals, dst_ptr):
    """vals cast to the element type of dst_ptr, saturating for an fp8 e4m3 cache."""
    if dst_ptr.dtype.element_ty == tl.float8e4nv:
        vals = tl.clamp(vals.to(tl.float32), -448.0, 448.0)
    return vals.to(dst_ptr.dtype.element_ty)


@triton.jit
def copy_rows(
    src_ptr,  # this token's [KVH, D] rows
    dst_ptr,  # the target slot's [KVH, D] rows
    s_src_h,
    s_dst_h,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    for h0 in range(0, num_heads, BLOCK_H):
        heads = h0 + offs_h
        mask = (heads[:, None] < num_heads) & (offs_d[None, :] < head_dim)
        vals = tl.load(src_ptr + heads[:, None] * s_src_h + offs_d[None, :], mask=mask)
        dst = dst_ptr + heads[:, None] * s_dst_h + offs_d[None, :]
        tl.store(dst, to_cache(vals, dst_ptr), mask=mask)


@triton.jit
def _store_kv_kernel(
    k_ptr,  # [T, KVH, D]
    v_ptr,  # [T, KVH, D]
    kc_ptr,  # [S, KVH, D]
    vc_ptr,  # [S, KVH, D]
    loc_ptr,  # [T] int64 slots
    sk_t,
    sk_h,
    sv_t,
    sv_h,
    skc_s,
    skc_h,
    svc_s,
    svc_h,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(loc_ptr + t).to(tl.int64)
    copy_rows(
        k_ptr + t * sk_t, kc_ptr + slot * skc_s, sk_h, skc_h, num_heads, head_dim, BLOCK_H, BLOCK_D
    )
    copy_rows(
        v_ptr + t * sv_t, vc_ptr + slot * svc_s, sv_h, svc_h, num_heads, head_dim, BLOCK_H, BLOCK_D
    )


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
) -> None:
    """k_cache[loc[t]] = k[t] and v_cache[loc[t]] = v[t] for every token t.

    k, v: [T, KVH, D] (strided views allowed, head dim contiguous); k_cache,
    v_cache: [S, KVH, D] (e.g. `KVCache.k[layer]`); loc: [T] int32/int64 slots.
    Slots are not range-checked (no host sync).
    NOTE: several tokens may target the same slot (padded rows all write the dummy
    page); the copies then race and the slot ends up holding, element by element,
    the value of one of those rows. Only slots nobody reads may be shared.
    """
    assert k.dim() == 3 and k.shape == v.shape and loc.shape == (k.shape[0],)
    assert k_cache.dim() == 3 and k_cache.shape[1:] == k.shape[1:]
    assert v_cache.shape == k_cache.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(1, min(triton.next_power_of_2(num_heads), 2048 // block_d))
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, loc,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        num_heads, head_dim,
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
