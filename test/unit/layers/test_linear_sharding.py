"""TP sharding of the linear layers: which rows (column-parallel) and columns
(row-parallel) of the full HF tensors each rank loads, KV-head replication, and the
errors on indivisible sizes. CPU only, no process group: each rank is built alone."""

import pytest
import torch

from gyrfalcon.forward.parallel import ParallelContext
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear

HIDDEN, D = 16, 4


def rank_ctx(rank: int, tp: int, comm=None) -> LayerContext:
    return LayerContext(parallel=ParallelContext(rank, tp, comm))


def heads_rows(first: int, count: int) -> slice:
    return slice(first * D, (first + count) * D)


@pytest.mark.parametrize(
    "heads,kv_heads,tp,q_of,kv_of",
    [
        # rank r: (first q head, count), (first kv head, count)
        (8, 2, 2, lambda r: (4 * r, 4), lambda r: (r, 1)),
        (8, 4, 2, lambda r: (4 * r, 4), lambda r: (2 * r, 2)),
        (8, 2, 4, lambda r: (2 * r, 2), lambda r: (r // 2, 1)),  # KV heads replicated x2
        (8, 1, 4, lambda r: (2 * r, 2), lambda r: (0, 1)),  # MQA: one KV head everywhere
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_qkv_rank_loads_its_query_heads_and_their_kv_heads(heads, kv_heads, tp, q_of, kv_of, bias):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(heads * D, HIDDEN, generator=gen)
    k, v = (torch.randn(kv_heads * D, HIDDEN, generator=gen) for _ in range(2))
    qb = torch.randn(heads * D, generator=gen)
    kb, vb = (torch.randn(kv_heads * D, generator=gen) for _ in range(2))
    for r in range(tp):
        layer = QKVParallelLinear(HIDDEN, D, heads, kv_heads, rank_ctx(r, tp), bias=bias)
        for sid, w, b in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
            layer.load("weight", w, sid)
            if bias:
                layer.load("bias", b, sid)
        qs, kvs = heads_rows(*q_of(r)), heads_rows(*kv_of(r))
        assert torch.equal(layer.weight, torch.cat([q[qs], k[kvs], v[kvs]]))
        if bias:
            assert torch.equal(layer.bias, torch.cat([qb[qs], kb[kvs], vb[kvs]]))
        # a checkpoint with the three packed in one tensor gives the same slices
        packed = QKVParallelLinear(HIDDEN, D, heads, kv_heads, rank_ctx(r, tp))
        packed.load("weight", torch.cat([q, k, v]))
        assert torch.equal(packed.weight, layer.weight)


@pytest.mark.parametrize("tp", [2, 4])
def test_gate_up_splits_each_part_and_down_splits_its_input(tp):
    inter = 24
    gen = torch.Generator().manual_seed(1)
    gate, up = (torch.randn(inter, HIDDEN, generator=gen) for _ in range(2))
    down = torch.randn(HIDDEN, inter, generator=gen)
    part = inter // tp
    for r in range(tp):
        gate_up = ColumnParallelLinear(
            HIDDEN, [inter, inter], rank_ctx(r, tp), shard_ids=["gate", "up"]
        )
        gate_up.load("weight", up, "up")  # any order
        gate_up.load("weight", gate, "gate")
        rows = slice(r * part, (r + 1) * part)
        assert torch.equal(gate_up.weight, torch.cat([gate[rows], up[rows]]))
        row = RowParallelLinear(inter, HIDDEN, rank_ctx(r, tp))
        row.load("weight", down)
        assert torch.equal(row.weight, down[:, rows])


class ThreadlessSum:
    """All-reduce over ranks run one after the other: collects the partial outputs and
    returns their running sum (the last rank's call returns the full sum)."""

    def __init__(self):
        self.total: torch.Tensor | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.total = x.clone() if self.total is None else self.total + x
        return self.total


@pytest.mark.parametrize("tp", [2, 4])
def test_row_parallel_partials_reduce_to_the_full_product(tp):
    inter, T = 24, 5
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(HIDDEN, inter, generator=gen, dtype=torch.float64)
    x = torch.randn(T, inter, generator=gen, dtype=torch.float64)
    comm = ThreadlessSum()
    part = inter // tp
    for r in range(tp):
        row = RowParallelLinear(inter, HIDDEN, rank_ctx(r, tp, comm)).double()
        row.load("weight", w)
        out = row(x[:, r * part : (r + 1) * part])  # each rank holds its slice of x
    torch.testing.assert_close(out, x @ w.T)


def test_single_rank_keeps_everything_and_reduces_nothing():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(HIDDEN, 24, generator=gen)
    row = RowParallelLinear(24, HIDDEN, LayerContext())
    row.load("weight", w)
    assert torch.equal(row.weight, w)
    x = torch.randn(3, 24, generator=gen)
    assert torch.equal(row(x), torch.nn.functional.linear(x, w))


def test_indivisible_sizes_are_a_clear_error():
    with pytest.raises(ValueError, match="6 attention heads do not split over tp size 4"):
        QKVParallelLinear(HIDDEN, D, 6, 2, rank_ctx(0, 4))
    with pytest.raises(ValueError, match="tp size 6 is neither a divisor nor a multiple"):
        QKVParallelLinear(HIDDEN, D, 12, 4, rank_ctx(0, 6))
    with pytest.raises(ValueError, match="size 10 does not split over tp size 4"):
        ColumnParallelLinear(HIDDEN, [10, 10], rank_ctx(0, 4))
    with pytest.raises(ValueError, match="size 10 does not split over tp size 4"):
        RowParallelLinear(10, HIDDEN, rank_ctx(0, 4))
