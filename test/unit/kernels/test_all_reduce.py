"""The one-shot all-reduce kernel (CPU interpreter), its ranks run one after another
(`one_shot_sim`).

The interpreter runs one launch at a time, so the ranks of a call take turns: before
rank r runs, every rank after it has "arrived" as its kernel's step 2 would leave it
(its part in r's buffer, slot p, half of its count, as words carrying the call's
flag); ranks before r ran for real. Each rank's kernel then does all four steps
itself. A kernel that waited on the wrong slot or flag would spin forever here (the
test hangs rather than passes).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: must precede every triton import

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402
from one_shot_sim import (  # noqa: E402
    HALF,
    Ranks,
    addends,
    close_to_reference,
    reference,
    words_of,
)

from gyrfalcon.kernels.all_reduce import (  # noqa: E402
    CHUNK,
    FLAG_PERIOD,
    MAX_ROWS,
    ROW_STRIDE,
    add_rmsnorm_fits,
    flag_of,
    one_shot_add_rmsnorm,
    one_shot_all_reduce,
    place_of,
    programs_for,
)
from gyrfalcon.kernels.norm import fused_add_rmsnorm  # noqa: E402


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
    # program 0's last two calls (sizes[2] at count 3, sizes[3] at count 4): both halves
    # of every receiver hold its peer's part with the flag of that call
    for count, call in ((3, 2), (4, 3)):
        n = min(sizes[call], CHUNK)
        for r in range(world):
            peer = 1 - r
            sent = words_of(history[call][peer][:n], flag_of(count))
            assert torch.equal(ranks.at(r, peer, count, 0, n), sent), (count, r)


def test_no_stale_part_carries_the_flag_a_program_waits_for():
    """float32 and bfloat16 calls through one buffer, each program's part at its own
    place whatever the element size: before every call, no program's place in the half
    of its next count already carries that count's flag, which a late peer's stale part
    would pass for (places counted in elements fail at the second call: the float32
    call's program 0 left flag 1 where the bfloat16 call's program 1 waits for flag 1).
    Every call sums right."""
    world = 3
    ranks = Ranks(world, torch.float32)
    calls = [(CHUNK, torch.float32), (2 * CHUNK, torch.bfloat16), (3 * CHUNK + 5, torch.float32),
             (4 * CHUNK, torch.bfloat16), (CHUNK + 1, torch.bfloat16), (4 * CHUNK, torch.float32)]  # fmt: skip
    for call, (n, dtype) in enumerate(calls):
        ranks.dtype = dtype
        for r in range(world):
            for b in range(programs_for(n)):
                use = int(ranks.uses[r][b]) + 1
                elems = min(CHUNK, n - b * CHUNK)
                for peer in set(range(world)) - {r}:
                    flags = ranks.at(r, peer, use, place_of(b), elems) >> 32
                    assert not flags.eq(flag_of(use)).all(), (call, r, peer, b)
        xs = addends(world, n, dtype, seed=call)
        for out in ranks.all_reduce(xs):
            close_to_reference(out, xs)


def test_a_peer_already_a_call_ahead():
    """A peer that finished this call may already have sent its next one (the other
    half): this rank's call and then its next both sum the right parts."""
    ranks = Ranks(2, torch.float32)
    ranks.all_reduce(addends(2, 10, torch.float32, seed=1))
    now, then = addends(2, 10, torch.float32, seed=2), addends(2, 10, torch.float32, seed=3)
    ranks.arrive_parts(1, [(0, 0, now[1])], waiting=0)
    ranks.arrive_parts(1, [(0, 0, then[1])], waiting=0, ahead=2)
    for xs in (now, then):
        out = torch.empty_like(xs[0])
        one_shot_all_reduce(xs[0], out, ranks.buf_ptrs, ranks.uses[0], 0, HALF)
        close_to_reference(out, xs)


def test_flags_never_zero_and_differ_two_calls_apart():
    """A fresh (zeroed) buffer never passes for a call, nor does the half's previous
    call (two before), across the wrap of the 31-bit flag."""
    for use in (1, 2, 3, FLAG_PERIOD - 1, FLAG_PERIOD, FLAG_PERIOD + 1, 5 * FLAG_PERIOD + 2):
        assert 0 < flag_of(use) < 2**31
        assert flag_of(use) != flag_of(use + 2)


def test_in_place_and_shape_checks():
    ranks = Ranks(2, torch.bfloat16)
    xs = addends(2, 64, torch.bfloat16, seed=3)
    ranks.arrive(1, xs[1], waiting=0)
    x0 = xs[0].clone()
    assert one_shot_all_reduce(x0, x0, ranks.buf_ptrs, ranks.uses[0], 0, HALF) is x0
    close_to_reference(x0, xs)
    with pytest.raises(AssertionError):  # larger than a buffer half
        big = torch.zeros(HALF + 1, dtype=torch.bfloat16)
        one_shot_all_reduce(big, big, ranks.buf_ptrs, ranks.uses[0], 0, HALF)


def rows_of(x: torch.Tensor) -> list:
    """The fused kernel's parts: row r is program r, at word r * ROW_STRIDE."""
    return [(r, r * ROW_STRIDE, x[r]) for r in range(x.shape[0])]


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("shape", [(1, 64), (3, 100), (MAX_ROWS, 48)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_sum_add_rmsnorm_equals_the_sum_then_fused_add_rmsnorm(world, shape, dtype):
    """The fused kernel gives, bit for bit, what the one-shot sum followed by
    kernels/norm.fused_add_rmsnorm gives, on every rank, in place; two calls in a
    row (both buffer halves)."""
    half = MAX_ROWS * ROW_STRIDE
    ranks = Ranks(world, dtype, half)
    g = torch.Generator().manual_seed(world * 100 + shape[0])
    weight = (1 + 0.1 * torch.randn(shape[1], generator=g)).to(dtype)
    for call in range(2):
        xs = [torch.randn(shape, generator=g).to(dtype) for _ in range(world)]
        residual = torch.randn(shape, generator=g).to(dtype)
        want_sum = reference([x.flatten() for x in xs]).to(dtype).view(shape)
        want = fused_add_rmsnorm(want_sum.clone(), residual.clone(), weight, 1e-6)
        for r in range(world):
            for p in range(r + 1, world):
                ranks.arrive_parts(p, rows_of(xs[p]), waiting=r)
            x, res = xs[r].clone(), residual.clone()
            got = one_shot_add_rmsnorm(
                x, res, weight, 1e-6, ranks.buf_ptrs, ranks.uses[r], r, half
            )  # fmt: skip
            assert got[0] is x and got[1] is res
            if dtype == torch.float32:
                assert torch.equal(res, want[1]) and torch.equal(x, want[0]), (call, r)
            else:  # NOTE: the interpreter truncates the sum's rounding (module docstring)
                torch.testing.assert_close(res, want[1], atol=0.05, rtol=0.02)
                torch.testing.assert_close(x, want[0], atol=0.05, rtol=0.02)


def test_what_the_fused_kernel_takes():
    half = MAX_ROWS * ROW_STRIDE
    assert add_rmsnorm_fits(torch.zeros(MAX_ROWS, ROW_STRIDE), half)
    assert not add_rmsnorm_fits(torch.zeros(MAX_ROWS + 1, 16), half)  # too many rows
    assert not add_rmsnorm_fits(torch.zeros(2, ROW_STRIDE + 1), half)  # too wide
    assert not add_rmsnorm_fits(torch.zeros(4, 32)[:, :16], half)  # not contiguous
    assert not add_rmsnorm_fits(torch.zeros(2, 16), half - 1)  # rows do not fit a half
