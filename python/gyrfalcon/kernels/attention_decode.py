"""Paged decode attention (one query token per row) with split-KV (flash-decoding).

One launch, one program per (row, KV head, KV split). The program handles every
query head that shares the KV head (GQA group, padded to BLOCK_H >= 16 so that
`tl.dot` applies), walks the split's KV positions through the page table, and
writes a partial output normalized by its own softmax sum plus the log-sum-exp
of the split. The program that finishes a (row, KV head) last (an atomic count
per pair says which) then merges the splits with weights exp(lse_split - max
lse) and writes the output: no second launch (a separate merge kernel cost ~1.7
us a layer at batch 1 on an H100, launch-bound). With one split the partial is
the output and goes straight to it.

Verify rows (T = k + 1 query tokens a page-table row, token i seeing the row's length
minus the T - 1 - i tokens after it) run one of two ways. Packed (`PACK`, where T x
GROUP query heads fit a block: `attention_launch.packs`): one program per (row, KV
head, split) holds all T tokens' heads of its KV head as the rows of its dots, each
row masked to its own causal length, so the row's keys are read once, not T times.
Otherwise one program row per query token, as for decode.

With `rope`, the kernel also does what `rotary_and_store` would in a launch of its
own: every program rotates its q heads in registers (each with its token's
position), and the program whose split holds a new token rotates its k and writes
k and v into the cache before it reads its keys (packed verify rows: each new
token by the program whose split holds it).

The grid is (bs, KVH, num_kv_splits) (packed: bs / T rows) whatever the lengths are: each
program derives its key range from seq_lens on the device, so a CUDA graph
captured for a batch size replays correctly for any lengths. A row of length 0 is
skipped, nothing of it read or written: a whole graph over any rows
(worker/piecewise_graph.py) runs its decode rows, the first ones, this way and the
rest on the extend kernel.

With PDL a program reads its row's metadata before it waits for the previous kernel
(`pdl_gate`); where the grid is small (`early_kv_block`; rows not packed), also its
split's first key block: page ids, keys and values of the positions before the step's
new tokens (written by earlier steps), read again after the wait if the block holds a
new token.

NOTE: log-sum-exps are kept in base 2 (scores are pre-multiplied by log2(e))
so both stages use exp2; they are only ever compared with each other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gyrfalcon.kernels.attention_launch import (
    LOG2E,
    DecodeRope,
    DecodeScratch,
    decode_constexprs,
    early_first_block,
    packs,
)
from gyrfalcon.kernels.device import launch_pdl
from gyrfalcon.kernels.kv_store import to_cache
from gyrfalcon.kernels.pdl import pdl_gate
from gyrfalcon.kernels.rotary import cos_sin_of, rotated_heads, rotated_rows
from gyrfalcon.kernels.split_merge import block_scores, merge_splits


# NOTE: the page table's row stride and the tokens per row vary from batch to batch
# in eager steps; specialized, each new value class would build the kernel again
# while serving (worker/compile_watch.py)
@triton.jit(do_not_specialize=["stride_pt", "tokens_per_row"])
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    seq_lens_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    count_ptr,  # [max_bs, >= KVH] int32 zeros: finished splits per (row, KV head)
    o_ptr,
    k_new_ptr,  # [bs, KVH, D] the new tokens' k before RoPE (when ROPE)
    v_new_ptr,  # [bs, KVH, D] their v (when ROPE)
    pos_ptr,  # [bs] the new tokens' positions (when ROPE)
    cos_sin_ptr,  # [max_pos, D] float32 cos | sin table (when ROPE)
    loc_ptr,  # [bs] the new tokens' cache slots (when ROPE)
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
    stride_cb,
    stride_ob,
    stride_oh,
    stride_knb,
    stride_knh,
    stride_vnb,
    stride_vnh,
    stride_cs,
    tokens_per_row,  # query tokens per page-table row (verify rows: k + 1)
    GROUP: tl.constexpr,
    PACK: tl.constexpr,  # a program holds its row's tokens (module docstring)
    BLOCK_T: tl.constexpr,  # new tokens a program may write (PACK: >= T, else 1)
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PRECISION: tl.constexpr,
    ROPE: tl.constexpr,
    EARLY_KV: tl.constexpr,  # the first key block read before the PDL gate (`early_kv_block`)
    F16_MATH: tl.constexpr,  # fp8 caches: dots in float16 (see decode_attention)
    PDL: tl.constexpr,
):
    row = tl.program_id(0)  # NOTE: PACK: a page-table row; else a query token
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    if PACK:  # block row i: token i // GROUP of the row, its head i % GROUP
        table_row = row
        first_tok = row * tokens_per_row  # this program's query tokens and new tokens
        n_tok = tokens_per_row
        tok_of = offs_h // GROUP
        mask_h = offs_h < tokens_per_row * GROUP
        heads = kvh * GROUP + offs_h % GROUP
        tok = first_tok + tok_of  # [BLOCK_H] each block row's query token
        row_len = tl.load(seq_lens_ptr + table_row)
        # token i of a row of T sees the row's length minus the T - 1 - i tokens after it
        vis = row_len - (tokens_per_row - 1 - tok_of)  # [BLOCK_H]
        seq_len = row_len
    else:
        table_row = row // tokens_per_row
        first_tok = row
        n_tok = 1
        mask_h = offs_h < GROUP
        heads = kvh * GROUP + offs_h  # [BLOCK_H] query heads of this KV head
        tok = row + offs_h * 0  # [BLOCK_H] this program's one query token
        row_len = tl.load(seq_lens_ptr + table_row)
        seq_len = row_len - (tokens_per_row - 1 - row % tokens_per_row)
        vis = seq_len + offs_h * 0  # NOTE: unused (the split's end masks the keys)
    if row_len < 1:  # NOTE: a row given no keys is no work (a whole graph's other rows)
        return
    # NOTE: the split length is rounded up to whole key blocks, so short rows use
    # only the first few splits; the rest have start >= end and stay empty.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if ROPE and not PACK:  # the token's position and cos/sin row (read once for every head)
        new_pos = tl.load(pos_ptr + row).to(tl.int64)
        cos, sin = cos_sin_of(
            cos_sin_ptr + new_pos * stride_cs, q_ptr.dtype.element_ty, HEAD_DIM, BLOCK_D
        )
    pt_row = page_table_ptr + table_row * stride_pt
    first_new = row_len - tokens_per_row  # the row's first position written this step
    if EARLY_KV:  # the split's first key block, as far as it lies before the new tokens
        pos0 = start + offs_n
        mask_n0 = pos0 < end
        page0 = tl.load(pt_row + pos0 // PAGE_SIZE, mask=mask_n0, other=0)
        slot0 = page0.to(tl.int64) * PAGE_SIZE + pos0 % PAGE_SIZE  # [BLOCK_N]
        k0_ptrs = k_ptr + slot0[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None]
        v0_ptrs = v_ptr + slot0[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :]
        old0 = mask_n0 & (pos0 < first_new)
        k0 = tl.load(k0_ptrs, mask=mask_d[:, None] & old0[None, :], other=0.0)
        v0 = tl.load(v0_ptrs, mask=old0[:, None] & mask_d[None, :], other=0.0)
    # NOTE: everything read above is the batch's metadata (lengths, positions, the cos/sin
    # table, page ids) or the cache of earlier steps' tokens, which no kernel of this
    # forward writes: read before the gate, it overlaps the previous kernel (the QKV
    # projection); q, the new tokens' k and v and their cache slots only after it
    pdl_gate(PDL)

    if ROPE:
        # RoPE of q in registers (every split, each block row at its token's
        # position); the split that holds a new token writes its rotated k and its v
        # into the cache, then reads them back below like any other key (no other
        # program reads that slot).
        if PACK:
            q_pos = tl.load(pos_ptr + tok, mask=mask_h, other=0).to(tl.int64)
            q = rotated_rows(
                q_ptr + tok * stride_qb + heads * stride_qh, mask_h,
                cos_sin_ptr + q_pos * stride_cs, HEAD_DIM, BLOCK_D,
            )  # fmt: skip  # [BLOCK_H, BLOCK_D]
            offs_t = tl.arange(0, BLOCK_T)
            new_tok = first_tok + offs_t
            new_pos = tl.load(pos_ptr + new_tok, mask=offs_t < n_tok, other=-1).to(tl.int64)
            mine = (offs_t < n_tok) & (new_pos >= start) & (new_pos < end)  # [BLOCK_T]
            if tl.sum(mine.to(tl.int32)) > 0:
                k_new = rotated_rows(
                    k_new_ptr + new_tok * stride_knb + kvh * stride_knh, mine,
                    cos_sin_ptr + tl.where(mine, new_pos, 0) * stride_cs, HEAD_DIM, BLOCK_D,
                )  # fmt: skip  # [BLOCK_T, BLOCK_D]
                mask_td = mine[:, None] & mask_d[None, :]
                v_new = tl.load(
                    v_new_ptr + new_tok[:, None] * stride_vnb + kvh * stride_vnh
                    + offs_d[None, :], mask=mask_td, other=0.0,
                )  # fmt: skip
                slot = tl.load(loc_ptr + new_tok, mask=mine, other=0).to(tl.int64)
                kc = k_ptr + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :]
                vc = v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :]
                tl.store(kc, to_cache(k_new, k_ptr), mask=mask_td)
                tl.store(vc, to_cache(v_new, v_ptr), mask=mask_td)
        else:  # one token: new_pos, cos and sin loaded before the gate
            q = rotated_heads(
                q_ptr + row * stride_qb, heads, stride_qh, mask_h, cos, sin, HEAD_DIM, BLOCK_D
            )  # [BLOCK_H, BLOCK_D]
            if (new_pos >= start) & (new_pos < end):
                one = tl.arange(0, 1)
                k_new = rotated_heads(
                    k_new_ptr + row * stride_knb, kvh + one, stride_knh, one < 1, cos, sin,
                    HEAD_DIM, BLOCK_D,
                )  # fmt: skip
                v_new = tl.load(
                    v_new_ptr + row * stride_vnb + kvh * stride_vnh + offs_d, mask=mask_d,
                    other=0.0,
                )  # fmt: skip
                slot = tl.load(loc_ptr + row).to(tl.int64)
                kc = k_ptr + slot * stride_ks + kvh * stride_kh + offs_d
                vc = v_ptr + slot * stride_vs + kvh * stride_vh + offs_d
                tl.store(kc[None, :], to_cache(k_new, k_ptr), mask=mask_d[None, :])
                tl.store(vc, to_cache(v_new, v_ptr), mask=mask_d)
        tl.debug_barrier()  # the stores above before any thread's loads below
    else:
        if PACK:
            q_ptrs = q_ptr + tok[:, None] * stride_qb + heads[:, None] * stride_qh
        else:
            q_ptrs = q_ptr + row * stride_qb + heads[:, None] * stride_qh
        q_ptrs = q_ptrs + offs_d[None, :]
        q = tl.load(q_ptrs, mask=mask_h[:, None] & mask_d[None, :], other=0.0)

    s_scale = qk_scale
    if F16_MATH:  # the scale rides in q, which keeps float16 far from overflow
        q = (q.to(tl.float32) * qk_scale).to(tl.float16)
        s_scale = 1.0
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    first_loop = start
    if EARLY_KV:
        if start < end:  # the block read before the gate, but for this step's tokens
            if tl.minimum(start + BLOCK_N, end) > first_new:  # read those after it
                k0 = tl.load(k0_ptrs, mask=mask_d[:, None] & mask_n0[None, :], other=0.0)
                v0 = tl.load(v0_ptrs, mask=mask_n0[:, None] & mask_d[None, :], other=0.0)
            m_i, alpha, p, l_i = block_scores(
                q, k0, pos0, mask_n0, vis, m_i, l_i, s_scale, PACK, PRECISION
            )
            acc = acc * alpha[:, None] + tl.dot(
                p.to(q.dtype), v0.to(q.dtype), input_precision=PRECISION
            )
        first_loop = start + BLOCK_N
    # NOTE: the loop spells out the first block's address math again, the values' after
    # the scores: a shared helper computing both pointer sets first (stop 66) changed what
    # the pipeliner makes of the loop (the 8B's fp8 build: 48 -> 1,176 bytes spilled)
    for n0 in range(first_loop, end, BLOCK_N):
        pos = n0 + offs_n  # [BLOCK_N] KV positions
        mask_n = pos < end
        page = tl.load(pt_row + pos // PAGE_SIZE, mask=mask_n, other=0)
        slot = page.to(tl.int64) * PAGE_SIZE + pos % PAGE_SIZE  # [BLOCK_N]
        k_ptrs = k_ptr + slot[None, :] * stride_ks + kvh * stride_kh + offs_d[:, None]
        k_t = tl.load(k_ptrs, mask=mask_d[:, None] & mask_n[None, :], other=0.0)
        m_i, alpha, p, l_i = block_scores(
            q, k_t, pos, mask_n, vis, m_i, l_i, s_scale, PACK, PRECISION
        )
        v_ptrs = v_ptr + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :]
        v = tl.load(v_ptrs, mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=PRECISION)

    # NOTE: an empty split (start >= end) stores lse = -inf and a zero output;
    # the merge gives it weight 0 and never reads its output.
    nonempty = l_i > 0.0
    out = tl.where(nonempty[:, None], acc / tl.where(nonempty, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    mo_ptrs = (
        mid_o_ptr
        + tok[:, None] * stride_mob
        + heads[:, None] * stride_moh
        + split * stride_mos
        + offs_d[None, :]
    )
    hd_mask = mask_h[:, None] & mask_d[None, :]
    # NOTE: with one split mid_o is the output itself (see decode_attention)
    tl.store(mo_ptrs, out.to(mid_o_ptr.dtype.element_ty), mask=hd_mask)
    if NUM_SPLITS > 1:
        tl.store(mid_lse_ptr + tok * stride_mlb + heads * stride_mlh + split, lse, mask=mask_h)
        # Every thread's partial must be stored before the count says so: a CTA
        # barrier, then a release (acq_rel, GPU scope) increment by one thread.
        tl.debug_barrier()
        count = count_ptr + row * stride_cb + kvh
        if tl.atomic_add(count, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
            tl.store(count, 0)  # the others are done: ready for the next launch
            for t in range(n_tok):  # NOTE: PACK: each token of the row; else the one
                merge_splits(
                    mid_o_ptr + (first_tok + t) * stride_mob,
                    mid_lse_ptr + (first_tok + t) * stride_mlb,
                    o_ptr + (first_tok + t) * stride_ob,
                    kvh * GROUP,
                    stride_moh,
                    stride_mos,
                    stride_mlh,
                    stride_oh,
                    GROUP,
                    HEAD_DIM,
                    NUM_SPLITS,
                    BLOCK_G,
                    BLOCK_S,
                    BLOCK_D,
                )


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
    rope: DecodeRope | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
    pdl: bool = True,
    tokens_per_row: int = 1,
    pack: bool = False,
) -> None:
    """Paged decode attention, written into `o` in place.

    q: [bs, H, D]; k_cache, v_cache: [slots, KVH, D]; page_table: [bs, max_pages]
    int32/int64; seq_lens: [bs] (KV length including the new token; 0: a row to skip,
    its o rows left unwritten);
    o: [bs, H, D]; scratch: from `alloc_decode_scratch` with max_bs >= bs.
    tokens_per_row = T > 1 (verify rows of k + 1 tokens, their K/V in the cache): q's
    bs = rows * T tokens, row r's at [r T, (r + 1) T), page_table and seq_lens per row
    ([rows, ...]); token i of a row attends causally to the row's first
    seq_len - (T - 1 - i) positions: the extend kernel's result, with the decode
    kernel's split-KV and one program per KV head. pack (where `packs`): one program
    per row and KV head holds all T tokens' heads (module docstring); scratch rows are
    still per query token.
    rope: None when q is rotated and the new K/V are in the cache already; else
    q is unrotated and the kernel rotates q and k and writes k, v (see DecodeRope),
    with the roundings of `rotary_and_store` (verify rows: packed only).
    The launch grid depends only on bs, T, KVH, H and scratch.num_kv_splits.
    block_n, num_stages: None = `decode_block_params`.
    pdl: may launch with programmatic dependent launch (where the device supports it).
    An fp8 cache with a 16-bit q does its dots in float16: q (pre-scaled) and the keys
    and values are converted to it. e4m3 -> float16 is one instruction per two values,
    exact; -> bfloat16 takes more, and with half the bytes per key an fp8 cache leaves
    the kernel bound by instructions (benchmarks/NOTES.md).
    """
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    splits = scratch.num_kv_splits
    t = tokens_per_row
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    group = num_heads // num_kv_heads
    assert not pack or packs(t, group), (t, group)
    assert t >= 1 and bs % t == 0 and (t == 1 or rope is None or pack), (t, bs)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2] == head_dim, (k_cache.shape, q.shape)
    assert page_table.dim() == 2 and page_table.shape[0] * t == bs, (page_table.shape, bs, t)
    assert seq_lens.shape == (bs // t,) and o.shape == q.shape, (seq_lens.shape, o.shape, q.shape)
    assert scratch.mid_o.shape[0] >= bs and scratch.mid_o.shape[1:] == (
        num_heads,
        splits,
        head_dim,
    ), (scratch.mid_o.shape, q.shape)
    assert scratch.counts.shape[0] >= bs and scratch.counts.shape[1] >= num_kv_heads
    assert q.stride(2) == 1 and k_cache.stride(2) == 1 and v_cache.stride(2) == 1
    assert o.stride(2) == 1 and page_table.stride(1) == 1
    assert scratch.mid_o.stride(3) == 1 and scratch.mid_lse.stride(2) == 1
    assert head_dim <= 256, f"head_dim {head_dim} > 256"
    if rope is not None:
        assert rope.k.shape == rope.v.shape == (bs, num_kv_heads, head_dim), rope.k.shape
        assert rope.k.stride(2) == 1 and rope.v.stride(2) == 1 and rope.k.dtype == q.dtype
        assert rope.positions.shape == rope.loc.shape == (bs,)
        assert rope.cos_sin.shape[1] == head_dim and rope.cos_sin.dtype == torch.float32
        assert rope.cos_sin.stride(1) == 1 and head_dim % 2 == 0
    fp8 = k_cache.element_size() == 1
    if bs == 0:
        return
    r = rope if rope is not None else DecodeRope(q, q, seq_lens, q, seq_lens)  # unused if None
    launch = launch_pdl(q, pdl)
    grid = (bs // t if pack else bs, num_kv_heads, splits)
    early = early_first_block(grid[0], k_cache, splits, pdl, pack)
    consts, num_stages = decode_constexprs(
        head_dim, group, t, pack, splits, page_size, q.dtype, fp8, rope is not None, launch,
        block_n, num_stages, early,
    )  # fmt: skip
    mid_o, mid_lse = scratch.mid_o, scratch.mid_lse
    # NOTE: one split needs no merge: its normalized output is final and goes straight
    # to o (the same float ops as the merge with a single weight of 1)
    direct = splits == 1
    mo = o if direct else mid_o
    mo_strides = (o.stride(0), o.stride(1), 0) if direct else mid_o.stride()[:3]
    _decode_split_kernel[grid](
        q, k_cache, v_cache, page_table, seq_lens, mo, mid_lse, scratch.counts, o,
        r.k, r.v, r.positions, r.cos_sin, r.loc,
        scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), page_table.stride(0),
        *mo_strides, mid_lse.stride(0), mid_lse.stride(1),
        scratch.counts.stride(0), o.stride(0), o.stride(1),
        r.k.stride(0), r.k.stride(1), r.v.stride(0), r.v.stride(1), r.cos_sin.stride(0), t,
        **consts, num_warps=num_warps, num_stages=num_stages, launch_pdl=launch,
    )  # fmt: skip
