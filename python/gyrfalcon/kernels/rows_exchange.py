"""DP attention's row gather and reduce-scatter, each in one Triton launch, on the
one-shot all-reduce's wire (`kernels/all_reduce.py`: 64-bit words that carry a
per-program flag, two buffer halves, every program's part at its own place in a slot).

Under DP attention every MoE layer gathers each rank's rows before the experts and
hands each rank back the sum of its own rows after them. NCCL does both in ~15-30 us
a layer and ends the chain of programmatic dependent launches. Here program b of rank r:

- gather: sends chunk b of its own rows to every peer (the same words to each), copies
  it into its own block of the output, and copies each peer's chunk b, once its words
  carry the call's flag, into that peer's block;
- reduce-scatter: sends peer p chunk b of the block that p keeps, and sums chunk b of
  its own block over the ranks, in rank order, in float32 (the bits of the one-shot
  all-reduce's sum, and of the rank-order sum).

Each rank sends (ranks - 1) parts of its own size, what NCCL's ring sends, in one
launch. The argument that two halves need no closing barrier is the all-reduce's
(every program counts its own calls; a kernel's state is its own): a peer can run at
most one call ahead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gyrfalcon.kernels.all_reduce import (
    CHUNK,
    MAX_PROGRAMS,
    await_words,
    call_of,
    check_buffers,
    elems_per_word,
    pack_words,
    programs_for,
    push_words,
    unpack_words,
    words_per_slot,
)
from gyrfalcon.kernels.device import launch_pdl
from gyrfalcon.kernels.pdl import pdl_gate


@triton.jit
def _chunk(pid, n, CHUNK: tl.constexpr, EPW: tl.constexpr):
    """Program pid's chunk of a part of n elements: its elements (offsets, mask) and
    its words at its own place in a slot (`place_of`; offsets, mask)."""
    start = pid * CHUNK
    offs = start + tl.arange(0, CHUNK)
    woffs = start + tl.arange(0, CHUNK // EPW)  # NOTE: place_of(pid) == pid * CHUNK
    return offs, offs < n, woffs, tl.arange(0, CHUNK // EPW) * EPW < n - start


@triton.jit
def _one_shot_gather_kernel(
    x_ptr,  # [n] this rank's rows
    out_ptr,  # [WORLD n] every rank's rows, rank r's at [r n, (r + 1) n)
    buf_ptrs,
    use_ptr,
    n,
    rank,
    slot_words,
    WORLD: tl.constexpr,
    CHUNK: tl.constexpr,
    EPW: tl.constexpr,
    PAIRS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_gate(PDL)
    pid = tl.program_id(0)
    offs, mask, woffs, wmask = _chunk(pid, n, CHUNK, EPW)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    use, flag, half = call_of(use_ptr, pid, WORLD, slot_words)
    words = pack_words(x, CHUNK, PAIRS) | (flag << 32)
    for p in tl.static_range(WORLD):
        if p != rank:
            push_words(buf_ptrs, p, half, rank, slot_words, woffs, words, wmask)
    for p in tl.static_range(WORLD):
        if p == rank:
            tl.store(out_ptr + p * n + offs, x, mask=mask)
        else:
            got = await_words(buf_ptrs, p, half, rank, slot_words, woffs, wmask, flag)
            tl.store(out_ptr + p * n + offs, unpack_words(got, x.dtype, CHUNK, PAIRS), mask=mask)
    tl.store(use_ptr + pid, use)


@triton.jit
def _one_shot_reduce_scatter_kernel(
    x_ptr,  # [WORLD n] this rank's addends, block p for rank p
    out_ptr,  # [n] the sum over the ranks of their block `rank`
    buf_ptrs,
    use_ptr,
    n,
    rank,
    slot_words,
    WORLD: tl.constexpr,
    CHUNK: tl.constexpr,
    EPW: tl.constexpr,
    PAIRS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_gate(PDL)
    pid = tl.program_id(0)
    offs, mask, woffs, wmask = _chunk(pid, n, CHUNK, EPW)
    use, flag, half = call_of(use_ptr, pid, WORLD, slot_words)
    for p in tl.static_range(WORLD):
        if p != rank:
            theirs = tl.load(x_ptr + p * n + offs, mask=mask, other=0.0)
            words = pack_words(theirs, CHUNK, PAIRS) | (flag << 32)
            push_words(buf_ptrs, p, half, rank, slot_words, woffs, words, wmask)
    mine = tl.load(x_ptr + rank * n + offs, mask=mask, other=0.0)
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for p in tl.static_range(WORLD):
        if p == rank:
            acc += mine.to(tl.float32)
        else:
            got = await_words(buf_ptrs, p, half, rank, slot_words, woffs, wmask, flag)
            acc += unpack_words(got, mine.dtype, CHUNK, PAIRS).to(tl.float32)
    tl.store(use_ptr + pid, use)
    tl.store(out_ptr + offs, acc.to(mine.dtype), mask=mask)


def rows_fit(part_elems: int, half_elems: int) -> bool:
    """Whether a rank's part of `part_elems` elements (its rows for a gather, one
    block for a reduce-scatter) goes through these kernels."""
    return 0 < part_elems <= half_elems and programs_for(part_elems) <= MAX_PROGRAMS


def _launch(kernel, x, out, n, buf_ptrs, uses, rank, half_elems, pdl) -> None:
    assert x.is_contiguous() and out.is_contiguous() and out.dtype == x.dtype, (x, out)
    assert rows_fit(n, half_elems), (n, half_elems)
    grid = programs_for(n)
    world = check_buffers(buf_ptrs, uses, rank, grid)
    assert {x.numel(), out.numel()} == {n, world * n}, (x.shape, out.shape, world)
    epw = elems_per_word(x)
    launch = launch_pdl(x, pdl)
    kernel[(grid,)](
        x, out, buf_ptrs, uses, n, rank, words_per_slot(half_elems),
        WORLD=world, CHUNK=CHUNK, EPW=epw, PAIRS=epw == 2, PDL=launch, num_warps=4,
        launch_pdl=launch,
    )  # fmt: skip


def one_shot_gather(
    x: torch.Tensor,
    buf_ptrs: torch.Tensor,
    uses: torch.Tensor,
    rank: int,
    half_elems: int,
    *,
    pdl: bool = True,
) -> torch.Tensor:
    """Every rank's x [m, ...] (the same shape on every rank, `rows_fit`) stacked in
    rank order: [world m, ...]. buf_ptrs, uses: as for `one_shot_all_reduce`, this
    kernel's own."""
    x = x.contiguous()
    out = x.new_empty((buf_ptrs.numel() * x.shape[0], *x.shape[1:]))
    _launch(_one_shot_gather_kernel, x, out, x.numel(), buf_ptrs, uses, rank, half_elems, pdl)
    return out


def one_shot_reduce_scatter(
    x: torch.Tensor,
    buf_ptrs: torch.Tensor,
    uses: torch.Tensor,
    rank: int,
    half_elems: int,
    *,
    pdl: bool = True,
) -> torch.Tensor:
    """This rank's block [m, ...] of the sum over the ranks of x [world m, ...] (each
    block `rows_fit`), summed in rank order in float32. buf_ptrs, uses: this kernel's
    own."""
    x = x.contiguous()
    world = buf_ptrs.numel()
    assert x.shape[0] % world == 0, (x.shape, world)
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    n = out.numel()
    _launch(_one_shot_reduce_scatter_kernel, x, out, n, buf_ptrs, uses, rank, half_elems, pdl)
    return out
