"""A one-shot all-reduce in one Triton launch, for the small sums of a TP decode step.

Each TP rank owns a receive buffer that every peer can write (torch's symmetric memory
over NVLink P2P; `forward/one_shot.py` makes it): two halves, each with one slot per
sending rank. Program `b` of rank r, for the b-th part of x (CHUNK elements, or one row
of the fused kernel):

1. counts the call: `use` is this program's count of calls (a per-rank counter per
   program index, in device memory, so a CUDA graph's replays advance it);
2. pushes its part into every peer's buffer, half `use % 2`, slot r, at the program's
   own place (`place_of`: the same words whatever the element size), as 64-bit words
   that each carry 32 bits of data (two 16-bit elements or one float32) and the flag
   `flag_of(use)` in their upper half;
3. reads its own buffer's slot p for every peer p until every word there carries the
   flag of this call;
4. sums every rank's part in rank order in float32 (the same order on every rank, so
   every rank gets the same bits) and writes the sum.

Why flags inside the data (the "LL" protocol of NCCL's small messages): an aligned
8-byte store arrives whole, so a word with the right flag holds the right data. No
fence, no separate flag write, no read across NVLink: a part costs one one-way trip.

Why two halves and no closing barrier: a peer that has our words of call `use` may run
ahead and start call `use + 1`, which writes the other half. It cannot start call
`use + 2` (writing the half we may still read) before finishing call `use + 1`, which
needs our words of call `use + 1`, sent only after this call has finished reading.
Flags compare for equality: a half holds the flag of call `use - 2` until the peer
writes call `use`'s. That holds because only program b ever writes program b's place:
were places counted in elements, a float32 call's program 0 would fill the words a
bfloat16 call's program 1 reads, with flags of program 0's count, which can equal the
flag program 1 waits for: a stale part summed as this call's (the calls of
test/gpu/test_all_reduce_gpu.py reach this; a rank of four H100s failed its exact
check there).

The kernel opens with the PDL gate like every decode-path kernel: launched with
programmatic dependent launch it keeps the chain of early launches that an NCCL kernel
breaks. Every program must be resident at once (a rank's program waits on its peers'
same program while others may wait on theirs), so `MAX_PROGRAMS` stays below the SM
count.
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
# the fused sum + add + RMSNorm: one program per row, row r's part at word r * ROW_STRIDE
MAX_ROWS = 16
ROW_STRIDE = MAX_PROGRAMS * CHUNK // MAX_ROWS  # the widest row it takes
FLAG_PERIOD = 0x7FFFFFFF  # flags run 1..FLAG_PERIOD, never the zero of a fresh buffer
_FLAG_PERIOD = tl.constexpr(FLAG_PERIOD)


def flag_of(use: int) -> int:
    """The flag of a program's `use`-th call (use >= 1): positive, below 2 ** 31, and
    different for calls two apart."""
    return (use - 1) % FLAG_PERIOD + 1


def words_per_slot(half_elems: int) -> int:
    """64-bit words of one sender's slot in a buffer half: CHUNK words (one per element
    of float32; 16-bit elements use half of them) for every program a call of
    half_elems elements runs."""
    return triton.cdiv(half_elems, CHUNK) * CHUNK


def place_of(program: int) -> int:
    """Where program `program`'s part of the sum kernel starts in a slot, in words:
    CHUNK words of its own, whatever the element size (the module docstring says why)."""
    return program * CHUNK


def buffer_words(world: int, half_elems: int) -> int:
    """64-bit words of a rank's receive buffer: two halves of `world` slots."""
    return 2 * world * words_per_slot(half_elems)


@triton.jit
def pack_words(x, BLOCK: tl.constexpr, PAIRS: tl.constexpr):
    """x [BLOCK] as the 32 data bits of BLOCK // 2 words (16-bit elements, PAIRS) or of
    BLOCK words (float32), as int64 with the upper half clear."""
    if PAIRS:
        bits = tl.reshape(x.to(tl.uint16, bitcast=True), [BLOCK // 2, 2])
        lo, hi = tl.split(bits)
        data = lo.to(tl.uint32) | (hi.to(tl.uint32) << 16)
    else:
        data = x.to(tl.uint32, bitcast=True)
    return data.to(tl.int64) & 0xFFFFFFFF


@triton.jit
def unpack_words(words, ety: tl.constexpr, BLOCK: tl.constexpr, PAIRS: tl.constexpr):
    """The inverse of `pack_words`: [BLOCK] elements of dtype ety from the words' low halves."""
    data = (words & 0xFFFFFFFF).to(tl.uint32)
    if PAIRS:
        lo = (data & 0xFFFF).to(tl.uint16)
        hi = (data >> 16).to(tl.uint16)
        values = tl.reshape(tl.join(lo, hi), [BLOCK]).to(ety, bitcast=True)
    else:
        values = data.to(ety, bitcast=True)
    return values


@triton.jit
def call_of(use_ptr, pid, WORLD: tl.constexpr, slot_words):
    """Step 1 for program pid: (its count of this call, the call's flag, the offset of
    the call's half in a buffer, in words)."""
    use = tl.load(use_ptr + pid) + 1
    flag = (use - 1) % _FLAG_PERIOD + 1  # flag_of(use)
    return use, flag, (use % 2) * WORLD * slot_words


@triton.jit
def push_words(buf_ptrs, peer, half, rank, slot_words, woffs, words, wmask):
    """Step 2 toward one peer: the words into its buffer, this half, slot `rank`."""
    dst = tl.load(buf_ptrs + peer).to(tl.pointer_type(tl.int64))
    tl.store(dst + half + rank * slot_words + woffs, words, mask=wmask)


@triton.jit
def await_words(buf_ptrs, peer, half, rank, slot_words, woffs, wmask, flag):
    """Step 3 for one peer: its words in this rank's buffer, this half, slot `peer`,
    once every one carries `flag`."""
    mine = tl.load(buf_ptrs + rank).to(tl.pointer_type(tl.int64))
    src = mine + half + peer * slot_words + woffs
    got = tl.load(src, mask=wmask, other=0, volatile=True)
    while tl.sum((wmask & ((got >> 32) != flag)).to(tl.int32), axis=0) > 0:
        got = tl.load(src, mask=wmask, other=0, volatile=True)
    return got


@triton.jit
def _exchange_sum(
    x,  # [BLOCK] this program's part of this rank's addend
    place,  # where the part starts in a slot, in words (the program's own: `place_of`)
    n,  # elements of the part (those of x past it are not sent)
    buf_ptrs,
    use_ptr,
    rank,
    slot_words,
    WORLD: tl.constexpr,
    BLOCK: tl.constexpr,
    EPW: tl.constexpr,  # elements per word: 2 (16-bit) or 1 (float32)
    PAIRS: tl.constexpr,  # EPW == 2
):
    """Steps 1-4 of the module docstring for program `program_id(0)`: the float32 sum
    over the ranks, in rank order, of what each rank's same program brought."""
    pid = tl.program_id(0)
    ety = x.dtype
    use, flag, half = call_of(use_ptr, pid, WORLD, slot_words)
    woffs = place + tl.arange(0, BLOCK // EPW)
    wmask = tl.arange(0, BLOCK // EPW) * EPW < n
    words = pack_words(x, BLOCK, PAIRS) | (flag << 32)
    for p in tl.static_range(WORLD):
        if p != rank:
            push_words(buf_ptrs, p, half, rank, slot_words, woffs, words, wmask)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for p in tl.static_range(WORLD):
        if p == rank:
            acc += x.to(tl.float32)
        else:
            got = await_words(buf_ptrs, p, half, rank, slot_words, woffs, wmask, flag)
            acc += unpack_words(got, ety, BLOCK, PAIRS).to(tl.float32)
    tl.store(use_ptr + pid, use)
    return acc


@triton.jit
def _one_shot_all_reduce_kernel(
    x_ptr,  # [n] this rank's addend
    out_ptr,  # [n] the sum (may be x)
    buf_ptrs,  # [WORLD] int64: each rank's receive buffer (`buffer_words`)
    use_ptr,  # [MAX_PROGRAMS] int64: this rank's count of calls per program
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
    start = tl.program_id(0) * CHUNK
    offs = start + tl.arange(0, CHUNK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    acc = _exchange_sum(
        x, tl.program_id(0) * CHUNK, n - start, buf_ptrs, use_ptr, rank, slot_words, WORLD,
        CHUNK, EPW, PAIRS,
    )  # fmt: skip
    tl.store(out_ptr + offs, acc.to(x.dtype), mask=mask)


@triton.jit
def _one_shot_add_rmsnorm_kernel(
    x_ptr,  # [M, H] this rank's addend; the normalized rows are written here
    res_ptr,  # [M, H] the residual stream: read, then the new stream written
    w_ptr,  # [H] the norm's weight
    buf_ptrs,
    use_ptr,
    H,
    eps,
    rank,
    slot_words,
    WORLD: tl.constexpr,
    ROW_STRIDE: tl.constexpr,
    BLOCK: tl.constexpr,
    EPW: tl.constexpr,
    PAIRS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_gate(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * H + cols, mask=mask, other=0.0)
    acc = _exchange_sum(
        x, row * ROW_STRIDE, H, buf_ptrs, use_ptr, rank, slot_words, WORLD, BLOCK, EPW,
        PAIRS,
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


def elems_per_word(x: torch.Tensor) -> int:
    assert x.element_size() in (2, 4), x.dtype
    return 4 // x.element_size()


def check_buffers(buf_ptrs: torch.Tensor, uses: torch.Tensor, rank: int, programs: int) -> int:
    world = buf_ptrs.numel()
    assert buf_ptrs.dtype == torch.int64 and 0 <= rank < world, (buf_ptrs.dtype, world, rank)
    assert uses.dtype == torch.int64 and uses.numel() >= programs, (uses.dtype, programs)
    return world


def one_shot_all_reduce(
    x: torch.Tensor,
    out: torch.Tensor,
    buf_ptrs: torch.Tensor,
    uses: torch.Tensor,
    rank: int,
    half_elems: int,
    *,
    pdl: bool = True,
) -> torch.Tensor:
    """out = the sum over the ranks of x (contiguous, 16- or 32-bit floats, at most
    half_elems and MAX_PROGRAMS * CHUNK elements; out may be x). buf_ptrs: int64
    [world] addresses of every rank's receive buffer (`buffer_words(world, half_elems)`
    int64 words, zero at the start); uses: this rank's int64 [MAX_PROGRAMS] call counts
    (zero at the start). Every rank calls it with the same shapes, in the same order."""
    n = x.numel()
    assert x.is_contiguous() and out.is_contiguous() and out.numel() == n, (x.shape, out.shape)
    assert out.dtype == x.dtype and 0 < n <= half_elems, (n, half_elems)
    grid = programs_for(n)
    assert grid <= MAX_PROGRAMS, grid
    world = check_buffers(buf_ptrs, uses, rank, grid)
    epw = elems_per_word(x)
    launch = launch_pdl(x, pdl)
    _one_shot_all_reduce_kernel[(grid,)](
        x, out, buf_ptrs, uses, n, rank, words_per_slot(half_elems),
        WORLD=world, CHUNK=CHUNK, EPW=epw, PAIRS=epw == 2, PDL=launch, num_warps=4,
        launch_pdl=launch,
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
    residual; both are returned. The buffers and counts are this kernel's own (not
    `one_shot_all_reduce`'s: a program's part must sit at one place in every call
    that shares its count), laid out as there."""
    assert add_rmsnorm_fits(x, half_elems), (x.shape, half_elems)
    assert residual.shape == x.shape and residual.dtype == x.dtype and residual.is_contiguous()
    m, hidden = x.shape
    assert weight.shape == (hidden,) and weight.is_contiguous()
    world = check_buffers(buf_ptrs, uses, rank, m)
    block, chunks, warps = norm_launch_params(hidden, None)
    assert chunks == 1, hidden
    epw = elems_per_word(x)
    launch = launch_pdl(x, pdl)
    _one_shot_add_rmsnorm_kernel[(m,)](
        x, residual, weight, buf_ptrs, uses, hidden, eps, rank, words_per_slot(half_elems),
        WORLD=world, ROW_STRIDE=ROW_STRIDE, BLOCK=block, EPW=epw, PAIRS=epw == 2, PDL=launch,
        num_warps=warps, launch_pdl=launch,
    )  # fmt: skip
    return x, residual
