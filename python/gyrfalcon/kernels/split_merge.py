"""The decode kernel's split-KV math: each split's online softmax over a key block
(`block_scores`), and the merge of the splits' partials (flash-decoding's second stage),
run by the program that finishes a (row, KV head) last, inside the decode launch."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def block_scores(
    q,  # [BLOCK_H, BLOCK_D]
    k_t,  # [BLOCK_D, BLOCK_N] a key block as the cache holds it
    pos,  # [BLOCK_N] its positions
    mask_n,  # [BLOCK_N] positions inside the split
    vis,  # [BLOCK_H] PACK: each block row's causal length (else unused)
    m_i,
    l_i,
    s_scale,
    PACK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """The online softmax over one key block: (the new running max, the factor of the
    old terms, the block's weights [BLOCK_H, BLOCK_N], the new running sum)."""
    s = tl.dot(q, k_t.to(q.dtype), input_precision=PRECISION) * s_scale  # [BLOCK_H, BLOCK_N]
    if PACK:  # each block row to its own token's causal length
        s = tl.where(mask_n[None, :] & (pos[None, :] < vis[:, None]), s, float("-inf"))
        # a row may see no key of a block (and none before it): m_new is -inf
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        s = tl.where(mask_n[None, :], s, float("-inf"))
        # every block inside [start, end) has a valid key, so m_new is finite
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)  # exp2(-inf) = 0 on the first block
    p = tl.exp2(s - m_use[:, None])  # [BLOCK_H, BLOCK_N]
    return m_new, alpha, p, l_i * alpha + tl.sum(p, 1)


@triton.jit
def merge_splits(
    mid_o_row,  # this row's partial outputs
    mid_lse_row,  # this row's partial log-sum-exps
    o_row,  # this row's output
    head0,  # first query head of the KV head
    stride_moh,
    stride_mos,
    stride_mlh,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """o = sum_s w_s * part_s / sum_s w_s with w_s = exp2(lse_s - max lse), for the
    GROUP heads of one KV head: every partial is loaded at once as a [head, split,
    dim] tile (one memory round trip, not one per split), BLOCK_G heads at a time.

    NOTE: the partials were written by other programs (other SMs): loads go through
    L2 (.cg), never a possibly stale L1 line."""
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    for g0 in tl.static_range(0, GROUP, BLOCK_G):  # BLOCK_G heads per tile
        offs_g = g0 + tl.arange(0, BLOCK_G)
        heads = head0 + offs_g
        gs_mask = (offs_g[:, None] < GROUP) & (offs_s[None, :] < NUM_SPLITS)  # [G, S]
        lse = tl.load(
            mid_lse_row + heads[:, None] * stride_mlh + offs_s[None, :],
            mask=gs_mask,
            other=float("-inf"),
            cache_modifier=".cg",
        )  # [BLOCK_G, BLOCK_S]
        valid = lse > float("-inf")  # empty splits (and padding) weigh 0, unread
        part_ptrs = (
            mid_o_row
            + heads[:, None, None] * stride_moh
            + offs_s[None, :, None] * stride_mos
            + offs_d[None, None, :]
        )
        part_mask = valid[:, :, None] & (offs_d[None, None, :] < HEAD_DIM)
        part = tl.load(part_ptrs, mask=part_mask, other=0.0, cache_modifier=".cg")  # [G, S, D]
        m = tl.max(lse, 1)
        m = tl.where(m > float("-inf"), m, 0.0)  # guard exp2(-inf - -inf) = NaN
        w = tl.where(valid, tl.exp2(lse - m[:, None]), 0.0)  # [BLOCK_G, BLOCK_S]
        denom = tl.sum(w, 1)
        out = tl.sum(w[:, :, None] * part, 1) / tl.where(denom > 0.0, denom, 1.0)[:, None]
        o_ptrs = o_row + heads[:, None] * stride_oh + offs_d[None, :]
        o_mask = (offs_g[:, None] < GROUP) & (offs_d[None, :] < HEAD_DIM)
        tl.store(o_ptrs, out.to(o_row.dtype.element_ty), mask=o_mask)


# Largest [heads, splits, dims] tile the merge loads at once (64 float32 registers per
# thread at 4 warps).
MERGE_TILE = 8192


def merge_heads_per_tile(group: int, splits: int, block_d: int) -> int:
    """Query heads per merge tile: the whole GQA group when its [group, splits, dims]
    partials fit MERGE_TILE elements, else the largest power of two that does (>= 1)."""
    per_head = triton.next_power_of_2(splits) * block_d
    return max(1, min(triton.next_power_of_2(group), MERGE_TILE // per_head))
