"""A one-shot all-reduce in one Triton launch, for the small sums of a TP decode step.

Each TP rank owns a data buffer and a flag area that every peer can address (torch's
symmetric memory over NVLink P2P; `forward/one_shot.py` makes them). Program `b` of
rank r, for the b-th chunk of CHUNK elements:

1. copies its chunk of x into its own buffer, half `use % 2`, where `use` is this
   program's count of calls (a per-rank counter per program index, in device memory,
   so a CUDA graph's replays advance it);
2. writes `use` into every peer's flag slot [b, r] (a release at system scope, after a
   block barrier, so the chunk is visible before the flag);
3. waits until its own slots [b, p] hold at least `use` for every peer p;
4. sums every rank's chunk in rank order in float32 (the same order on every rank, so
   every rank gets the same bits) and writes the sum.

Why two halves and no closing barrier: a peer that has seen our flag `use` may run
ahead and start call `use + 1`, which writes the other half. It cannot start call
`use + 2` (writing the half we may still read) before it has our flag `use + 1`, which
we write only after this call has finished reading. Flags only grow (int64), so a
peer already at `use + 1` still satisfies the wait for `use`.

The kernel opens with the PDL gate like every decode-path kernel: launched with
programmatic dependent launch it keeps the chain of early launches that an NCCL kernel
breaks. Every program must be resident at once (they wait on each other's peers), so
`MAX_PROGRAMS` stays below the SM count.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gyrfalcon.kernels.device import launch_pdl
from gyrfalcon.kernels.pdl import pdl_gate

CHUNK = 2048  # elements per program
MAX_PROGRAMS = 64  # programs of one call at most (every one resident: < the SM count)


@triton.jit
def _one_shot_all_reduce_kernel(
    x_ptr,  # [n] this rank's addend
    out_ptr,  # [n] the sum (may be x)
    buf_ptrs,  # [WORLD] int64: each rank's data buffer, two halves of half_elems
    flag_ptrs,  # [WORLD] int64: each rank's flags, int64 [MAX_PROGRAMS, WORLD]
    use_ptr,  # [MAX_PROGRAMS] int64: this rank's count of calls per program
    n,
    rank,
    half_elems,
    WORLD: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_gate(PDL)
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    mask = offs < n
    ety = x_ptr.dtype.element_ty
    use = tl.load(use_ptr + pid) + 1
    half = (use % 2) * half_elems
    x = tl.load(x_ptr + offs, mask=mask)
    mine = tl.load(buf_ptrs + rank).to(tl.pointer_type(ety))
    tl.store(mine + half + offs, x, mask=mask)
    tl.debug_barrier()  # NOTE: the whole chunk written before the flag goes out
    slot = pid * WORLD
    for p in tl.static_range(WORLD):
        if p != rank:
            peer_flags = tl.load(flag_ptrs + p).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(peer_flags + slot + rank, use, sem="release", scope="sys")
    my_flags = tl.load(flag_ptrs + rank).to(tl.pointer_type(tl.int64))
    for p in tl.static_range(WORLD):
        if p != rank:
            while tl.atomic_add(my_flags + slot + p, 0, sem="acquire", scope="sys") < use:
                pass
    tl.debug_barrier()  # NOTE: no thread reads a peer's chunk before its flag was seen
    acc = tl.zeros([CHUNK], dtype=tl.float32)
    for p in tl.static_range(WORLD):
        if p == rank:
            acc += x.to(tl.float32)
        else:
            src = tl.load(buf_ptrs + p).to(tl.pointer_type(ety))
            # NOTE: volatile: the same addresses held another call's chunk two uses ago
            acc += tl.load(src + half + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(ety), mask=mask)
    tl.store(use_ptr + pid, use)


def programs_for(numel: int) -> int:
    """Programs of one call over `numel` elements (one per CHUNK)."""
    return triton.cdiv(numel, CHUNK)


def one_shot_all_reduce(
    x: torch.Tensor,
    out: torch.Tensor,
    buf_ptrs: torch.Tensor,
    flag_ptrs: torch.Tensor,
    uses: torch.Tensor,
    rank: int,
    half_elems: int,
    *,
    pdl: bool = True,
) -> torch.Tensor:
    """out = the sum over the ranks of x (contiguous, at most half_elems and
    MAX_PROGRAMS * CHUNK elements; out may be x). buf_ptrs / flag_ptrs: int64 [world]
    addresses of every rank's data buffer (two halves of half_elems elements of x's
    dtype) and flags (int64 [MAX_PROGRAMS, world], zero at the start on every rank);
    uses: this rank's int64 [MAX_PROGRAMS] call counts (zero at the start). Every rank
    calls it with the same shapes, in the same order."""
    n = x.numel()
    world = buf_ptrs.numel()
    assert x.is_contiguous() and out.is_contiguous() and out.numel() == n, (x.shape, out.shape)
    assert out.dtype == x.dtype and 0 < n <= half_elems, (n, half_elems)
    assert flag_ptrs.numel() == world and 0 <= rank < world, (world, rank)
    grid = programs_for(n)
    assert grid <= MAX_PROGRAMS and uses.numel() >= grid, (grid, uses.numel())
    launch = launch_pdl(x, pdl)
    _one_shot_all_reduce_kernel[(grid,)](
        x, out, buf_ptrs, flag_ptrs, uses, n, rank, half_elems,
        WORLD=world, CHUNK=CHUNK, PDL=launch, num_warps=4, launch_pdl=launch,
    )  # fmt: skip
    return out
