"""The one-shot all-reduce kernel (CPU interpreter), its ranks run one after another.

The interpreter runs one launch at a time, so the ranks of a call take turns: before
rank r runs, every rank after it has "arrived" as its kernel's own first two steps
would leave it (its chunk in its buffer half, its flag in r's slots); ranks before r
ran for real. Each rank's kernel then does all four steps itself. A kernel that waited
on the wrong slot would spin forever here (the test hangs rather than passes).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: must precede every triton import

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402

from gyrfalcon.kernels.all_reduce import (  # noqa: E402
    CHUNK,
    MAX_PROGRAMS,
    one_shot_all_reduce,
    programs_for,
)

HALF = 4 * CHUNK  # the tests' largest tensor


class Ranks:
    """The buffers, flags and call counts of `world` simulated ranks."""

    def __init__(self, world: int, dtype: torch.dtype):
        self.world, self.dtype = world, dtype
        self.data = [torch.full((2 * HALF,), float("nan"), dtype=dtype) for _ in range(world)]
        self.flags = [torch.zeros(MAX_PROGRAMS * world, dtype=torch.int64) for _ in range(world)]
        self.uses = [torch.zeros(MAX_PROGRAMS, dtype=torch.int64) for _ in range(world)]
        self.buf_ptrs = torch.tensor([t.data_ptr() for t in self.data], dtype=torch.int64)
        self.flag_ptrs = torch.tensor([t.data_ptr() for t in self.flags], dtype=torch.int64)

    def arrive(self, p: int, x: torch.Tensor, waiting: int) -> None:
        """Rank p's first two steps for its next call: its chunks in its buffer half,
        its flags in rank `waiting`'s slots."""
        for b in range(programs_for(x.numel())):
            use = int(self.uses[p][b]) + 1
            lo, hi = b * CHUNK, min((b + 1) * CHUNK, x.numel())
            self.data[p][(use % 2) * HALF + lo : (use % 2) * HALF + hi] = x[lo:hi]
            self.flags[waiting][b * self.world + p] = use

    def all_reduce(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """One call of every rank (in rank order), each with its own addend."""
        outs = []
        for r in range(self.world):
            for p in range(r + 1, self.world):
                self.arrive(p, xs[p], waiting=r)
            out = torch.empty_like(xs[r])
            one_shot_all_reduce(
                xs[r], out, self.buf_ptrs, self.flag_ptrs, self.uses[r], r, HALF
            )  # fmt: skip
            outs.append(out)
        return outs


def addends(world: int, n: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) for _ in range(world)]


def reference(xs: list[torch.Tensor]) -> torch.Tensor:
    """The sum in rank order in float32."""
    acc = torch.zeros(xs[0].shape, dtype=torch.float32)
    for x in xs:
        acc += x.float()
    return acc


def close_to_reference(out: torch.Tensor, xs: list[torch.Tensor]) -> None:
    """float32: exactly the rank-order sum; 16-bit: that sum rounded once (the
    interpreter truncates where the GPU rounds to nearest: within one unit)."""
    want = reference(xs)
    if out.dtype == torch.float32:
        assert torch.equal(out, want)
        return
    ulp = want.abs().clamp_min(1e-30) * torch.finfo(out.dtype).eps
    assert ((out.float() - want).abs() <= ulp).all(), (out, want)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("n", [1, 37, CHUNK, CHUNK + 5, 3 * CHUNK + 1])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_rank_gets_the_same_sum(world, n, dtype):
    ranks = Ranks(world, dtype)
    xs = addends(world, n, dtype, seed=world * 1000 + n)
    outs = ranks.all_reduce(xs)
    for out in outs[1:]:
        assert torch.equal(out, outs[0])  # bit for bit the same on every rank
    close_to_reference(outs[0], xs)


def test_calls_alternate_halves_and_count_per_program():
    """Consecutive calls of different sizes: each program's count advances only when
    it runs, its chunk goes to the half of its count, and the half before it is kept
    (what a peer one call behind may still read)."""
    world = 2
    ranks = Ranks(world, torch.float32)
    sizes = [3 * CHUNK, CHUNK, 2 * CHUNK + 3, 5]
    history = []
    for call, n in enumerate(sizes):
        xs = addends(world, n, torch.float32, seed=call)
        outs = ranks.all_reduce(xs)
        for out in outs:
            close_to_reference(out, xs)
        history.append(xs)
    # program b ran in the calls with more than b chunks
    runs = [sum(programs_for(n) > b for n in sizes) for b in range(3)]
    assert runs == [4, 2, 2]
    for r in range(world):
        assert ranks.uses[r][:3].tolist() == runs and ranks.uses[r][3:].eq(0).all()
        peer = 1 - r
        for b, count in enumerate(runs):
            assert int(ranks.flags[peer][b * world + r]) == count  # r's flag in the peer's slot
    # program 0's last two calls (sizes[2] at count 3, sizes[3] at count 4): both halves
    for count, call in ((3, 2), (4, 3)):
        n = min(sizes[call], CHUNK)
        half = (count % 2) * HALF
        for r in range(world):
            assert torch.equal(ranks.data[r][half : half + n], history[call][r][:n])


def test_a_peer_already_a_call_ahead_satisfies_the_wait():
    """Flags only grow: a peer that finished this call and signalled the next one
    (its flag one higher) does not make this rank wait forever."""
    ranks = Ranks(2, torch.float32)
    first = addends(2, 10, torch.float32, seed=1)
    ranks.all_reduce(first)
    xs = addends(2, 10, torch.float32, seed=2)
    ranks.arrive(1, xs[1], waiting=0)
    ranks.flags[0][1] += 1  # rank 1 is already at its next call
    out = torch.empty_like(xs[0])
    one_shot_all_reduce(xs[0], out, ranks.buf_ptrs, ranks.flag_ptrs, ranks.uses[0], 0, HALF)
    close_to_reference(out, xs)


def test_in_place_and_shape_checks():
    ranks = Ranks(2, torch.bfloat16)
    xs = addends(2, 64, torch.bfloat16, seed=3)
    ranks.arrive(1, xs[1], waiting=0)
    x0 = xs[0].clone()
    assert (
        one_shot_all_reduce(x0, x0, ranks.buf_ptrs, ranks.flag_ptrs, ranks.uses[0], 0, HALF) is x0
    )
    close_to_reference(x0, xs)
    with pytest.raises(AssertionError):  # larger than a buffer half
        big = torch.zeros(HALF + 1, dtype=torch.bfloat16)
        one_shot_all_reduce(big, big, ranks.buf_ptrs, ranks.flag_ptrs, ranks.uses[0], 0, HALF)
