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
from gyrfalcon.kernels.norm import norm_launch_params
from gyrfalcon.kernels.pdl import pdl_gate

CHUNK = 2048  # elements per program
MAX_PROGRAMS = 64  # programs of one call at most (every one resident: < the SM count)
# the fused sum + add + RMSNorm: one program per row, row r's part at r * ROW_STRIDE
MAX_ROWS = 16
ROW_STRIDE = MAX_PROGRAMS * CHUNK // MAX_ROWS  # the widest row it takes


@triton.jit
def _exchange_sum(
    x,  # [BLOCK] this program's part of this rank's addend
    offs,  # [BLOCK] where it goes in a buffer half
    mask,
    buf_ptrs,
    flag_ptrs,
    use_ptr,
    rank,
    half_elems,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Steps 1-4 of the module docstring for program `program_id(0)`: the float32 sum
    over the ranks, in rank order, of what each rank's same program brought."""
    pid = tl.program_id(0)
    ety = x.dtype
    use = tl.load(use_ptr + pid) + 1
    half = (use % 2) * half_elems
    mine = tl.load(buf_ptrs + rank).to(tl.pointer_type(ety))
    tl.store(mine + half + offs, x, mask=mask)
    tl.debug_barrier()  # NOTE: the whole part written before the flag goes out
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
    tl.debug_barrier()  # NOTE: no thread reads a peer's part before its flag was seen
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(WORLD):
        if p == rank:
            acc += x.to(tl.float32)
        else:
            src = tl.load(buf_ptrs + p).to(tl.pointer_type(ety))
            # NOTE: volatile: the same addresses held another call's part two uses ago
            acc += tl.load(src + half + offs, mask=mask, other=0.0, volatile=True).to(tl.float32)
    tl.store(use_ptr + pid, use)
    return acc


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
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    acc = _exchange_sum(
        x, offs, mask, buf_ptrs, flag_ptrs, use_ptr, rank, half_elems, WORLD, CHUNK
    )  # fmt: skip
    tl.store(out_ptr + offs, acc.to(x.dtype), mask=mask)


@triton.jit
def _one_shot_add_rmsnorm_kernel(
    x_ptr,  # [M, H] this rank's addend; the normalized rows are written here
    res_ptr,  # [M, H] the residual stream: read, then the new stream written
    w_ptr,  # [H] the norm's weight
    buf_ptrs,
    flag_ptrs,
    use_ptr,
    H,
    eps,
    rank,
    half_elems,
    WORLD: tl.constexpr,
    ROW_STRIDE: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_gate(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0)
    acc = _exchange_sum(
        x, row * ROW_STRIDE + cols, mask, buf_ptrs, flag_ptrs, use_ptr, rank, half_elems,
        WORLD, BLOCK,
    )  # fmt: skip
    # NOTE: from here the numerics of kernels/norm.fused_add_rmsnorm on the rounded sum
    r = tl.load(res_ptr + row * H + cols, mask=mask, other=0.0)
    h = (acc.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype)
    tl.store(res_ptr + row * H + cols, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / H + eps)
    normed = (hf * rstd).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(x_ptr + row * H + cols, (w * normed).to(dtype), mask=mask)


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


def add_rmsnorm_fits(x: torch.Tensor, half_elems: int) -> bool:
    """Whether `one_shot_add_rmsnorm` takes x: [M, H] contiguous, M <= MAX_ROWS,
    H <= ROW_STRIDE, within a buffer half."""
    return (
        x.dim() == 2
        and 1 <= x.shape[0] <= MAX_ROWS
        and x.shape[1] <= ROW_STRIDE
        and MAX_ROWS * ROW_STRIDE <= half_elems
        and x.is_contiguous()
    )


def one_shot_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    buf_ptrs: torch.Tensor,
    flag_ptrs: torch.Tensor,
    uses: torch.Tensor,
    rank: int,
    half_elems: int,
    *,
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(s + residual), s + residual) where s is the sum over the ranks of x
    [M, H] (`add_rmsnorm_fits`), rounded to x's dtype as `one_shot_all_reduce` gives
    it: the numbers of that sum followed by `kernels/norm.fused_add_rmsnorm`, in one
    launch. In place: the normalized rows go to x, the new residual stream to
    residual; both are returned. The buffers, flags and counts are this kernel's own
    (not `one_shot_all_reduce`'s: a program's part must sit at one place in every
    call that shares its count), laid out as there."""
    assert add_rmsnorm_fits(x, half_elems), (x.shape, half_elems)
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
    m, hidden = x.shape
    assert weight.shape == (hidden,) and weight.is_contiguous()
    world = buf_ptrs.numel()
    assert flag_ptrs.numel() == world and 0 <= rank < world and uses.numel() >= m
    block, chunks, warps = norm_launch_params(hidden, None)
    assert chunks == 1, hidden
    launch = launch_pdl(x, pdl)
    _one_shot_add_rmsnorm_kernel[(m,)](
        x, residual, weight, buf_ptrs, flag_ptrs, uses, hidden, eps, rank, half_elems,
        WORLD=world, ROW_STRIDE=ROW_STRIDE, BLOCK=block, PDL=launch, num_warps=warps,
        launch_pdl=launch,
    )  # fmt: skip
    return x, residual
