"""Paged extend attention: prefill, prefill chunks after a cached prefix, verify.

Row r has q_len new query tokens at q[q_start : q_start + q_len] and seq_len KV
positions already in the paged cache (the new tokens' K/V included). Its
prefix_len = seq_len - q_len; new token i sits at position prefix_len + i and
attends causally to KV positions [0, prefix_len + i]. A decode row is the case
q_len == 1, a verify row the case q_len == k + 1.

One program per (query block, row, query head) runs an online softmax over key
blocks gathered through the page table. The grid is (cdiv(max_q_len, BLOCK_M),
bs, H); programs whose query block lies past their row's q_len exit at once.

Flat grid (`flat=True`, for CUDA graphs over batches whose rows change from replay to
replay): the grid is (cdiv(T, BLOCK_M) + min(bs, T), 1, H), a bound on the query
blocks of any rows of T tokens in all (each row's cdiv(q_len, BLOCK_M) <= q_len /
BLOCK_M + 1). Program i finds its (row, block) on the device from the q_lens alone:
with nb_r = cdiv(q_len_r, BLOCK_M) and cum_r = nb_0 + .. + nb_r, its row is the count
of rows with cum_r <= i and its block i - (cum_row - nb_row); past the last block it
exits. Rows of q_len 0 own no block (the spare rows of a graph's static batch), and
tokens no row covers are left unwritten.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gyrfalcon.kernels.attention_launch import LOG2E, dot_precision


# NOTE: the page table's row stride varies from batch to batch (specialized, a new
# value class would build the kernel again while serving: worker/compile_watch.py)
@triton.jit(do_not_specialize=["stride_pt", "num_rows"])
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    page_table_ptr,
    q_starts_ptr,
    q_lens_ptr,
    seq_lens_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_pt,
    num_rows,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
    FLAT: tl.constexpr,
    ROWS_BLOCK: tl.constexpr,
):
    head = tl.program_id(2)
    if FLAT:  # NOTE: module docstring: (row, block) from the q_lens' block counts
        i = tl.program_id(0)
        offs_r = tl.arange(0, ROWS_BLOCK)
        lens = tl.load(q_lens_ptr + offs_r, mask=offs_r < num_rows, other=0)
        blocks = (lens + BLOCK_M - 1) // BLOCK_M
        ends = tl.cumsum(blocks, 0)
        row = tl.sum((ends <= i).to(tl.int32), 0)
        if row >= num_rows:
            return
        mblk = i - tl.sum(tl.where(offs_r < row, blocks, 0), 0)
    else:
        mblk = tl.program_id(0)
        row = tl.program_id(1)
    q_len = tl.load(q_lens_ptr + row)
    if mblk * BLOCK_M >= q_len:
        return
    q_start = tl.load(q_starts_ptr + row)
    seq_len = tl.load(seq_lens_ptr + row)
    prefix = seq_len - q_len
    kvh = head // GROUP

    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] query index in the row
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < q_len
    mask_d = offs_d < HEAD_DIM
    tok = (q_start + offs_m).to(tl.int64)  # [BLOCK_M] token index in [T]
    q_ptrs = q_ptr + tok[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=mask_m[:, None] & mask_d[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    q_pos = prefix + offs_m  # [BLOCK_M] KV position of each query token

    # keys beyond the last query of this block are masked for every query in it
    kv_end = tl.minimum(seq_len, prefix + tl.minimum((mblk + 1) * BLOCK_M, q_len))
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    pt_row = page_table_ptr + row * stride_pt
    for n0 in range(0, kv_end, BLOCK_N):
        pos = n0 + offs_n  # [BLOCK_N] KV positions
        mask_n = pos < kv_end
        page = tl.load(pt_row + pos // PAGE_SIZE, mask=mask_n, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE  # [BLOCK_N]
        k_ptrs = k_ptr + slot[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None]
        k_t = tl.load(k_ptrs, mask=mask_d[:, None] & mask_n[None, :], other=0.0).to(q.dtype)
        s = tl.dot(q, k_t, input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N]
        keep = (pos[None, :] <= q_pos[:, None]) & mask_n[None, :]
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # NOTE: a query row can see no key in a block only after an earlier block
        # gave it key 0, so m_new is finite for real rows; the guard keeps padded
        # query rows (offs_m >= q_len) free of exp2(-inf - -inf) = NaN anyway.
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :]
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    o_ptrs = o_ptr + tok[:, None] * stride_ot + head * stride_oh + offs_d[None, :]
    tl.store(o_ptrs, out.to(o_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_block_sizes(max_q_len: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): query blocks shrink for short rows (decode, verify)."""
    block_m = min(64, max(16, triton.next_power_of_2(max_q_len)))
    block_n = 64 if triton.next_power_of_2(head_dim) <= 128 else 32
    return block_m, block_n


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    seq_lens: torch.Tensor,
    o: torch.Tensor,
    max_q_len: int,
    page_size: int,
    scale: float,
    block_m: int | None = None,
    block_n: int | None = None,
    flat: bool = False,
) -> None:
    """Paged causal attention of each row's new tokens, written into `o` in place.

    q: [T, H, D]; k_cache, v_cache: [slots, KVH, D]; page_table: [bs, max_pages]
    int32/int64; q_starts, q_lens, seq_lens: [bs] with 1 <= q_len <= seq_len;
    o: [T, H, D]; max_q_len >= every q_len (sets the grid and the query block).
    flat: the flat grid (module docstring), whose size depends on T and bs only; rows
    may then have q_len 0 (no work), their q_lens summing to at most T.
    NOTE: tokens of [T] that no row covers are left unwritten in `o`.
    """
    num_tokens, num_heads, head_dim = q.shape
    bs = q_lens.shape[0]
    num_kv_heads = k_cache.shape[1]
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == head_dim, (k_cache.shape, q.shape)
    assert page_table.dim() == 2 and page_table.shape[0] == bs, (page_table.shape, bs)
    assert q_starts.shape == (bs,) and seq_lens.shape == (bs,), (q_starts.shape, seq_lens.shape)
    assert o.shape == q.shape, (o.shape, q.shape)
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    assert o.stride(2) == 1 and page_table.stride(1) == 1
    assert head_dim <= 256, f"head_dim {head_dim} > 256"
    if bs == 0 or num_tokens == 0:
        return
    assert max_q_len >= 1, max_q_len
    default_m, default_n = extend_block_sizes(max_q_len, head_dim)
    block_m = block_m or default_m
    block_n = block_n or default_n
    if flat:
        grid = (triton.cdiv(num_tokens, block_m) + min(bs, num_tokens), 1, num_heads)
    else:
        grid = (triton.cdiv(max_q_len, block_m), bs, num_heads)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        o,
        page_table,
        q_starts,
        q_lens,
        seq_lens,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        o.stride(0),
        o.stride(1),
        page_table.stride(0),
        bs,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        PAGE_SIZE=page_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),  # tl.dot needs K >= 16
        PRECISION=dot_precision(q.dtype),
        FLAT=flat,
        ROWS_BLOCK=triton.next_power_of_2(bs) if flat else 1,
        num_warps=4,
        num_stages=2,
    )
