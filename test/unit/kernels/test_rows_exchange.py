"""DP attention's one-shot row gather and reduce-scatter (kernels/rows_exchange.py) in
the CPU interpreter, the ranks of a call taking turns (`one_shot_sim`: before rank r
runs, every later rank has arrived as its kernel's step 2 would leave it; earlier ranks
ran for real). A kernel that waited on the wrong slot, place or flag would spin forever
here (the test hangs rather than passes)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: must precede every triton import

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402
from one_shot_sim import HALF, Ranks, close_to_reference  # noqa: E402

from gyrfalcon.kernels.all_reduce import CHUNK, MAX_PROGRAMS  # noqa: E402
from gyrfalcon.kernels.rows_exchange import (  # noqa: E402
    one_shot_gather,
    one_shot_reduce_scatter,
    rows_fit,
)


def rows(world: int, m: int, hidden: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(m, hidden, generator=g).to(dtype) for _ in range(world)]


def gather(ranks: Ranks, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One gather call of every rank, in rank order."""
    ranks.dtype = xs[0].dtype
    outs = []
    for r in range(ranks.world):
        for p in range(r + 1, ranks.world):
            ranks.arrive(p, xs[p].flatten(), waiting=r)
        outs.append(one_shot_gather(xs[r], ranks.buf_ptrs, ranks.uses[r], r, ranks.half))
    return outs


def reduce_scatter(ranks: Ranks, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One reduce-scatter call of every rank, in rank order: rank p sends rank r the
    block r of its addend."""
    ranks.dtype, world = xs[0].dtype, ranks.world
    outs = []
    for r in range(world):
        for p in range(r + 1, world):
            ranks.arrive(p, xs[p].view(world, -1)[r], waiting=r)
        x = xs[r]
        outs.append(one_shot_reduce_scatter(x, ranks.buf_ptrs, ranks.uses[r], r, ranks.half))
    return outs


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("m,hidden", [(1, 48), (3, 100), (2, CHUNK + 7), (4, CHUNK)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_gives_every_rank_every_ranks_rows_in_rank_order(world, m, hidden, dtype):
    xs = rows(world, m, hidden, dtype, seed=world * 100 + m)
    for out in gather(Ranks(world, dtype), xs):
        assert out.shape == (world * m, hidden)
        assert torch.equal(out, torch.cat(xs))  # bit for bit: copies, no arithmetic


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("m,hidden", [(1, 48), (3, 100), (2, CHUNK + 7), (4, CHUNK)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_reduce_scatter_gives_each_rank_its_block_of_the_rank_order_sum(world, m, hidden, dtype):
    xs = rows(world, world * m, hidden, dtype, seed=world * 10 + m)
    outs = reduce_scatter(Ranks(world, dtype), xs)
    for r, out in enumerate(outs):
        assert out.shape == (m, hidden)
        close_to_reference(out.flatten(), [x.view(world, -1)[r] for x in xs])


def test_calls_of_several_sizes_and_dtypes_through_one_buffer():
    """A graph's step gathers and scatters rows of one size; the next step's may be
    another size or (a float32 drafter beside a bfloat16 target, say) another dtype:
    every call right, each kernel with its own buffers and counts."""
    world = 3
    gathers, scatters = Ranks(world, torch.float32), Ranks(world, torch.float32)
    calls = [(2, CHUNK, torch.float32), (4, CHUNK, torch.bfloat16), (1, 64, torch.float32),
             (3, CHUNK + 1, torch.bfloat16), (4, CHUNK, torch.float32)]  # fmt: skip
    for i, (m, hidden, dtype) in enumerate(calls):
        xs = rows(world, m, hidden, dtype, seed=i)
        assert all(torch.equal(out, torch.cat(xs)) for out in gather(gathers, xs)), i
        xs = rows(world, world * m, hidden, dtype, seed=100 + i)
        for r, out in enumerate(reduce_scatter(scatters, xs)):
            close_to_reference(out.flatten(), [x.view(world, -1)[r] for x in xs])


def test_what_the_kernels_take():
    assert rows_fit(1, HALF) and rows_fit(HALF, HALF)
    assert not rows_fit(0, HALF) and not rows_fit(HALF + 1, HALF)
    assert not rows_fit(MAX_PROGRAMS * CHUNK + 1, 2 * MAX_PROGRAMS * CHUNK)  # programs
    ranks = Ranks(2, torch.float32)
    with pytest.raises(AssertionError):  # a block larger than a buffer half
        one_shot_reduce_scatter(
            torch.zeros(2, HALF + 1), ranks.buf_ptrs, ranks.uses[0], 0, ranks.half
        )  # fmt: skip
    with pytest.raises(AssertionError):  # rows that do not split into the ranks' blocks
        one_shot_reduce_scatter(torch.zeros(3, 4), ranks.buf_ptrs, ranks.uses[0], 0, ranks.half)
