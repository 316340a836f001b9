"""The TP context (forward/parallel.py) and the head-sharding math (config/sharding.py)."""

import pytest
import torch

from gyrfalcon.config.sharding import HeadShard, even_shard, local_heads, shard_heads
from gyrfalcon.forward.parallel import SINGLE_RANK, ParallelContext


@pytest.mark.parametrize(
    "heads,kv_heads,tp,want",
    [
        # tp <= KV heads: both split evenly
        (32, 8, 1, [HeadShard(32, 8, 0, 0)]),
        (32, 8, 2, [HeadShard(16, 4, 0, 0), HeadShard(16, 4, 16, 4)]),
        (32, 8, 8, [HeadShard(4, 1, 4 * r, r) for r in range(8)]),
        # tp > KV heads: one KV head per rank, each on tp / KVH consecutive ranks
        (8, 2, 4, [HeadShard(2, 1, 2 * r, r // 2) for r in range(4)]),
        (32, 8, 16, [HeadShard(2, 1, 2 * r, r // 2) for r in range(16)]),
        (4, 1, 4, [HeadShard(1, 1, r, 0) for r in range(4)]),  # MQA: replicated everywhere
        (4, 4, 2, [HeadShard(2, 2, 0, 0), HeadShard(2, 2, 2, 2)]),  # MHA
    ],
)
def test_each_rank_holds_its_heads(heads, kv_heads, tp, want):
    got = [shard_heads(heads, kv_heads, r, tp) for r in range(tp)]
    assert got == want
    assert local_heads(heads, kv_heads, tp) == (want[0].num_heads, want[0].num_kv_heads)
    group = heads // kv_heads
    for s in got:
        # a rank's query heads are exactly the ones that read its KV heads
        q_heads = range(s.head_start, s.head_start + s.num_heads)
        assert {h // group for h in q_heads} == set(
            range(s.kv_head_start, s.kv_head_start + s.num_kv_heads)
        )
    # every query head on exactly one rank; every KV head on at least one
    assert sorted(h for s in got for h in range(s.head_start, s.head_start + s.num_heads)) == list(
        range(heads)
    )
    assert {s.kv_head_start + i for s in got for i in range(s.num_kv_heads)} == set(range(kv_heads))


@pytest.mark.parametrize(
    "heads,kv_heads,tp,match",
    [
        (9, 3, 2, "9 attention heads do not split over tp size 2"),
        (12, 3, 2, "3 KV heads do not split over tp size 2"),  # tp < KVH, not a divisor
        (12, 4, 6, "tp size 6 is neither a divisor nor a multiple of 4 KV heads"),
        (8, 3, 1, "8 query heads do not group over 3 KV heads"),
    ],
)
def test_indivisible_head_counts_are_a_clear_error(heads, kv_heads, tp, match):
    with pytest.raises(ValueError, match=match):
        shard_heads(heads, kv_heads, 0, tp)
    with pytest.raises(ValueError, match=match):
        ParallelContext(0, tp).heads(heads, kv_heads)


def test_even_shard():
    assert [even_shard(12, r, 3) for r in range(3)] == [(0, 4), (4, 4), (8, 4)]
    assert ParallelContext(1, 2).even_shard(128) == (64, 64)
    with pytest.raises(ValueError, match="size 10 does not split over tp size 4"):
        even_shard(10, 0, 4)


def test_rank_must_be_in_its_group():
    with pytest.raises(ValueError):
        ParallelContext(tp_rank=2, tp_size=2)
    with pytest.raises(ValueError):
        ParallelContext(tp_rank=0, tp_size=0)
    with pytest.raises(ValueError):
        shard_heads(8, 2, 4, 4)


class SumOf:
    """A communicator whose group's other ranks hold fixed tensors."""

    def __init__(self, others: list[torch.Tensor]):
        self.others = others

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x + sum(self.others)


def test_all_reduce_is_the_identity_at_tp_1_and_goes_through_the_communicator_above():
    x = torch.randn(3, 4)
    assert SINGLE_RANK.all_reduce(x) is x  # no copy on the single-rank path
    assert ParallelContext(0, 1, SumOf([torch.ones(3, 4)])).all_reduce(x) is x
    two = ParallelContext(1, 2, SumOf([torch.ones(3, 4)]))
    assert torch.equal(two.all_reduce(x), x + 1)
    with pytest.raises(RuntimeError, match="tp size 2 needs a communicator"):
        ParallelContext(0, 2).all_reduce(x)
