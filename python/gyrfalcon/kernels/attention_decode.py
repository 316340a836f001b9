"""Paged decode attention (one query token per row) with split-KV (flash-decoding).

Stage 1 runs one program per (row, KV head, KV split). The program handles every
query head that shares the KV head (GQA group, padded to BLOCK_H >= 16 so that
`tl.dot` applies), walks the split's KV positions through the page table, and
writes a partial output normalized by its own softmax sum plus the log-sum-exp
of the split. Stage 2 runs one program per (row, query head) and merges the
splits with weights exp(lse_split - max lse).

The grid is (bs, KVH, num_kv_splits) whatever the sequence lengths are: each
program derives its key range from seq_lens on the device, so a CUDA graph
captured for a batch size replays correctly for any lengths.

NOTE: log-sum-exps are kept in base 2 (scores are pre-multiplied by log2(e))
so both stages use exp2; they are only ever compared with each other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@dataclass
class DecodeScratch:
    """Caller-owned partials of stage 1, reusable across layers and steps."""

    mid_o: torch.Tensor  # [max_bs, H, num_kv_splits, D] float32
    mid_lse: torch.Tensor  # [max_bs, H, num_kv_splits] float32 (base-2 log-sum-exp)

    @property
    def num_kv_splits(self) -> int:
        return int(self.mid_lse.shape[2])


def alloc_decode_scratch(
    max_bs: int, num_heads: int, head_dim: int, num_kv_splits: int, device: torch.device
) -> DecodeScratch:
    """Scratch for `decode_attention` on batches of up to max_bs rows."""
    assert max_bs >= 1 and num_kv_splits >= 1, (max_bs, num_kv_splits)
    return DecodeScratch(
        mid_o=torch.empty(
            (max_bs, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=device
        ),
        mid_lse=torch.empty((max_bs, num_heads, num_kv_splits), dtype=torch.float32, device=device),
    )


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact (IEEE) dots instead of tf32; 16-bit inputs ignore this."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    seq_lens_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_h  # [BLOCK_H] query heads of this KV head

    q_ptrs = q_ptr + row * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]

    seq_len = tl.load(seq_lens_ptr + row)
    # NOTE: the split length is rounded up to whole key blocks, so short rows use
    # only the first few splits; the rest have start >= end and stay empty.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    pt_row = page_table_ptr + row * stride_pt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n  # [BLOCK_N] KV positions
        mask_n = pos < end
        page = tl.load(pt_row + pos // PAGE_SIZE, mask=mask_n, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE  # [BLOCK_N]
        kv_mask = mask_d[:, None] & mask_n[None, :]
        k_ptrs = k_ptr + slot[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None]
        k_t = tl.load(k_ptrs, mask=kv_mask, other=0.0).to(q.dtype)  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        # every block inside [start, end) has a valid key, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)  # exp2(-inf) = 0 on the first block
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_H, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :]
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # NOTE: an empty split (start >= end) stores lse = -inf and a zero output;
    # stage 2 gives it weight 0 and never reads its output.
    nonempty = l_i > 0.0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    mo_ptrs = (
        mid_o_ptr
        + row * stride_mob
        + heads[:, None] * stride_moh
        + split * stride_mos
        + offs_d[None, :]
    )
    # NOTE: with one split mid_o is the output itself (see decode_attention)
    tl.store(mo_ptrs, out.to(mid_o_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
    tl.store(mid_lse_ptr + row * stride_mlb + heads * stride_mlh + split, lse, mask=mask_h)


@triton.jit
def _decode_reduce_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    o_ptr,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    lse_ptrs = mid_lse_ptr + row * stride_mlb + head * stride_mlh + offs_s
    lse = tl.load(lse_ptrs, mask=offs_s < NUM_SPLITS, other=float("-inf"))  # [BLOCK_S]
    valid = lse > float("-inf")
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)  # guard exp2(-inf - -inf) = NaN
    w = tl.where(valid, tl.exp2(lse - m), 0.0)  # [BLOCK_S]
    mo_ptrs = (
        mid_o_ptr
        + row * stride_mob
        + head * stride_moh
        + offs_s[:, None] * stride_mos
        + offs_d[None, :]
    )
    part = tl.load(mo_ptrs, mask=valid[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_S, BLOCK_D]
    denom = tl.sum(w, 0)
    out = tl.sum(w[:, None] * part, 0) / tl.where(denom > 0.0, denom, 1.0)  # [BLOCK_D]
    o_ptrs = o_ptr + row * stride_ob + head * stride_oh + offs_d
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask_d)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    o: torch.Tensor,
    scratch: DecodeScratch,
    page_size: int,
    scale: float,
    block_n: int | None = None,
) -> None:
    """Paged decode attention, written into `o` in place.

    q: [bs, H, D]; k_cache, v_cache: [slots, KVH, D]; page_table: [bs, max_pages]
    int32/int64; seq_lens: [bs] (>= 1, KV length including the new token);
    o: [bs, H, D]; scratch: from `alloc_decode_scratch` with max_bs >= bs.
    The launch grid depends only on bs, KVH, H and scratch.num_kv_splits.
    """
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    splits = scratch.num_kv_splits
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == head_dim, (k_cache.shape, q.shape)
    assert page_table.dim() == 2 and page_table.shape[0] == bs, (page_table.shape, bs)
    assert seq_lens.shape == (bs,) and o.shape == q.shape, (seq_lens.shape, o.shape, q.shape)
    assert scratch.mid_o.shape[0] >= bs and scratch.mid_o.shape[1:] == (
        num_heads,
        splits,
        head_dim,
    ), (scratch.mid_o.shape, q.shape)
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    assert o.stride(2) == 1 and page_table.stride(1) == 1
    assert scratch.mid_o.stride(3) == 1 and scratch.mid_lse.stride(2) == 1
    assert head_dim <= 256, f"head_dim {head_dim} > 256"
    if bs == 0:
        return
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    if block_n is None:
        block_n = 64 if block_d <= 128 else 32
    mid_o, mid_lse = scratch.mid_o, scratch.mid_lse
    # NOTE: one split needs no merge: its normalized output is final and goes straight
    # to o (the same float ops as the merge with a single weight of 1), saving a launch
    direct = splits == 1
    mo = o if direct else mid_o
    mo_strides = (o.stride(0), o.stride(1), 0) if direct else mid_o.stride()[:3]
    _decode_split_kernel[(bs, num_kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        seq_lens,
        mo,
        mid_lse,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        page_table.stride(0),
        *mo_strides,
        mid_lse.stride(0),
        mid_lse.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        NUM_SPLITS=splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        PRECISION=dot_precision(q.dtype),
        num_warps=4,
        num_stages=2,
    )
    if direct:
        return
    _decode_reduce_kernel[(bs, num_heads)](
        mid_o,
        mid_lse,
        o,
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        o.stride(0),
        o.stride(1),
        HEAD_DIM=head_dim,
        NUM_SPLITS=splits,
        BLOCK_S=triton.next_power_of_2(splits),
        BLOCK_D=block_d,
        num_warps=4,
    )
