"""The "align" step of the fused MoE (`kernels/fused_moe.py`): which rows of the grouped
GEMMs each (token, slot) pair takes, on the device, sized by shapes only.

The pairs are grouped by expert into segments, each padded
to a multiple of BLOCK_M rows, so that a block of BLOCK_M rows belongs to one expert:

    c_e  = #{p : ids[p] = e}                      the pairs routed to expert e
    n_e  = ceil(c_e / BLOCK_M)                    its blocks
    s_e  = BLOCK_M * sum_{e' < e} n_e'            the row its segment starts at
    row(p) = s_e + #{p' < p : ids[p'] = e}        (a stable, deterministic order)
    sorted_pair[row(p)] = p;  the segment's n_e BLOCK_M - c_e padding rows hold the
        sentinel P (a pair index past the last, masked wherever it is read)
    block_expert[b] = #{e : sum_{e' <= e} n_e' <= b}   (>= E past the live blocks)

The live block count sum_e n_e is only known on the device, so the grids use the
shape-only bound `max_blocks`: at most min(E, P) experts have pairs and each pads by
fewer than BLOCK_M rows, so sum_e n_e <= (P + min(E, P) (BLOCK_M - 1)) // BLOCK_M.
Programs of blocks past the live count read block_expert >= E and exit at once. The
ranks #{p' < p : ids[p'] = e} come from a one-hot [chunk, E] cumulative sum per chunk
of pairs: with one chunk (decode) one program does everything in registers
(`_align_one_chunk_kernel`); else `_count_kernel` counts every chunk's pairs,
`_layout_kernel` (one program) turns the counts into prefixes over chunks and the
layout, and `_scatter_kernel` ranks every chunk's pairs again and writes their rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gyrfalcon.kernels.pdl import pdl_gate

# Elements of the align kernels' [rows, E] integer tiles (one-hot, prefix, block search).
ALIGN_TILE_ELEMS = 8192


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Shape-only bound on the live blocks sum_e ceil(c_e / block_m) (sum_e c_e <=
    num_pairs, at most min(E, P) of the c_e nonzero): (P + min(E, P)(block_m - 1)) //
    block_m."""
    assert num_pairs >= 0 and num_experts >= 1 and block_m >= 1
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def align_tile(num_experts: int) -> tuple[int, int]:
    """(E_PAD, rows): the align kernels' tiles are [rows, E_PAD], E_PAD the power of
    two >= E and rows * E_PAD <= ALIGN_TILE_ELEMS (rows a power of two >= 16)."""
    e_pad = triton.next_power_of_2(num_experts)
    return e_pad, max(16, ALIGN_TILE_ELEMS // e_pad)


@dataclass(frozen=True)
class MoeLayout:
    sorted_pair: torch.Tensor  # [max_blocks * block_m] int32: pair per row, P = padding
    block_expert: torch.Tensor  # [max_blocks] int32: each block's expert, >= E when dead


@triton.jit
def _chunk_ranks(ids_ptr, chunk, num_pairs, num_experts, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """A chunk's pairs: (offs [CHUNK], one-hot experts [CHUNK, E_PAD] int32, rank [CHUNK]:
    #{earlier pairs of the chunk with the same expert}; all-zero rows, rank -1, for
    invalid ids (< 0, >= E) and lanes past P)."""
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    offs_e = tl.arange(0, E_PAD)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1)
    onehot = ((ids[:, None] == offs_e[None, :]) & (offs_e[None, :] < num_experts)).to(tl.int32)
    rank = tl.sum(tl.cumsum(onehot, axis=0) * onehot, axis=1) - 1
    return offs, onehot, rank


@triton.jit
def _write_layout(
    total, block_expert_ptr, sorted_pair_ptr, num_pairs, num_blocks,
    ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    """From c_e (total [E_PAD]): the sentinel into every segment's padding rows and
    block_expert [num_blocks = max_blocks]; returns s_e [E_PAD]."""
    n_blk = (total + BLOCK_M - 1) // BLOCK_M
    blk_end = tl.cumsum(n_blk, axis=0)  # inclusive: sum_{e' <= e} n_e'
    start = (blk_end - n_blk) * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    pad = offs_m[None, :] < (n_blk * BLOCK_M - total)[:, None]  # [E_PAD, BLOCK_M]
    pad_rows = (start + total)[:, None] + offs_m[None, :]
    tl.store(sorted_pair_ptr + pad_rows, tl.zeros_like(pad_rows) + num_pairs, mask=pad)
    for b0 in range(0, num_blocks, ROWS):
        offs_b = b0 + tl.arange(0, ROWS)
        ended = (blk_end[None, :] <= offs_b[:, None]).to(tl.int32)  # [ROWS, E_PAD]
        tl.store(block_expert_ptr + offs_b, tl.sum(ended, axis=1), mask=offs_b < num_blocks)
    return start


@triton.jit
def _store_rows(sorted_pair_ptr, offs, onehot, rank, base):
    """sorted_pair[base[e] + rank] = p for a chunk's valid pairs (base [E_PAD])."""
    row = tl.sum(onehot * base[None, :], axis=1) + rank  # -1 where invalid
    tl.store(sorted_pair_ptr + row, offs, mask=row >= 0)


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_one_chunk_kernel(
    ids_ptr, block_expert_ptr, sorted_pair_ptr, num_pairs, num_experts, num_blocks,
    E_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """The whole layout of ids [P <= CHUNK] (any integer dtype), in one program."""
    pdl_gate(PDL)
    offs, onehot, rank = _chunk_ranks(ids_ptr, 0, num_pairs, num_experts, E_PAD, CHUNK)
    total = tl.sum(onehot, axis=0)
    start = _write_layout(
        total, block_expert_ptr, sorted_pair_ptr, num_pairs, num_blocks, CHUNK, BLOCK_M
    )
    _store_rows(sorted_pair_ptr, offs, onehot, rank, start)


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(
    ids_ptr, counts_ptr, num_pairs, num_experts,
    E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Per chunk of ids [P]: its pairs per expert, counts [C, E_PAD]."""
    pdl_gate(PDL)
    chunk = tl.program_id(0)
    _, onehot, _ = _chunk_ranks(ids_ptr, chunk, num_pairs, num_experts, E_PAD, CHUNK)
    tl.store(counts_ptr + chunk * E_PAD + tl.arange(0, E_PAD), tl.sum(onehot, axis=0))


@triton.jit(do_not_specialize=["num_chunks", "num_pairs", "num_blocks"])
def _layout_kernel(
    counts_ptr, row_start_ptr, block_expert_ptr, sorted_pair_ptr, num_chunks, num_pairs,
    num_blocks, E_PAD: tl.constexpr, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    """One program: counts [C, E_PAD] become each chunk's pairs per expert in earlier
    chunks (in place); writes s_e (row_start [E_PAD]) and `_write_layout`'s rows."""
    pdl_gate(PDL)
    offs_e = tl.arange(0, E_PAD)
    total = tl.zeros((E_PAD,), dtype=tl.int32)
    for c0 in range(0, num_chunks, ROWS):
        offs_c = c0 + tl.arange(0, ROWS)
        ptrs = counts_ptr + offs_c[:, None] * E_PAD + offs_e[None, :]
        mask = offs_c[:, None] < num_chunks
        cnt = tl.load(ptrs, mask=mask, other=0)
        tl.store(ptrs, total[None, :] + tl.cumsum(cnt, axis=0) - cnt, mask=mask)
        total += tl.sum(cnt, axis=0)
    start = _write_layout(
        total, block_expert_ptr, sorted_pair_ptr, num_pairs, num_blocks, ROWS, BLOCK_M
    )
    tl.store(row_start_ptr + offs_e, start)


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_kernel(
    ids_ptr, prefix_ptr, row_start_ptr, sorted_pair_ptr, num_pairs, num_experts,
    E_PAD: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Per chunk: sorted_pair[s_e + prefix[chunk, e] + rank] = p for its valid pairs."""
    pdl_gate(PDL)
    chunk = tl.program_id(0)
    offs, onehot, rank = _chunk_ranks(ids_ptr, chunk, num_pairs, num_experts, E_PAD, CHUNK)
    offs_e = tl.arange(0, E_PAD)
    base = tl.load(row_start_ptr + offs_e) + tl.load(prefix_ptr + chunk * E_PAD + offs_e)
    _store_rows(sorted_pair_ptr, offs, onehot, rank, base)


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int, pdl: bool) -> MoeLayout:
    """The block layout of the module docstring for the pairs' expert ids [P] (P >= 1,
    contiguous: topk_ids flattened), on the device, sized by shapes only. pdl: launch
    with PDL (the caller checked support)."""
    assert ids.dim() == 1 and ids.is_contiguous(), ids.shape
    num_pairs, dev = ids.numel(), ids.device
    blocks = max_blocks(num_pairs, num_experts, block_m)
    assert num_pairs >= 1 and blocks * block_m < 2**31, (num_pairs, blocks)  # int32 rows
    e_pad, rows = align_tile(num_experts)
    num_chunks = triton.cdiv(num_pairs, rows)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=dev)
    sorted_pair = torch.empty(blocks * block_m, dtype=torch.int32, device=dev)
    common = dict(E_PAD=e_pad, PDL=pdl, launch_pdl=pdl)
    if num_chunks == 1:  # decode: one program; counts and ranks stay in registers
        _align_one_chunk_kernel[(1,)](
            ids, block_expert, sorted_pair, num_pairs, num_experts, blocks,
            CHUNK=rows, BLOCK_M=block_m, num_warps=8, **common,
        )  # fmt: skip
        return MoeLayout(sorted_pair, block_expert)
    counts = torch.empty(num_chunks, e_pad, dtype=torch.int32, device=dev)
    row_start = torch.empty(e_pad, dtype=torch.int32, device=dev)
    _count_kernel[(num_chunks,)](ids, counts, num_pairs, num_experts, CHUNK=rows, **common)
    _layout_kernel[(1,)](
        counts, row_start, block_expert, sorted_pair, num_chunks, num_pairs, blocks,
        ROWS=rows, BLOCK_M=block_m, num_warps=8, **common,
    )  # fmt: skip
    _scatter_kernel[(num_chunks,)](
        ids, counts, row_start, sorted_pair, num_pairs, num_experts, CHUNK=rows, **common
    )
    return MoeLayout(sorted_pair, block_expert)
