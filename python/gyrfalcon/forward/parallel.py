"""Tensor parallelism as the layers see it: this rank's place in its TP group, the
all-reduce that sums row-parallel partial outputs, the all-gather that joins the
vocab-parallel LM head's logits; the head-, vocabulary- and expert-sharding math it
applies is `config/sharding.py`.

MoE layers shard one of two ways over the same group (`ParallelContext.ep_size`):
MoE-TP (ep_size 1: every rank holds every expert, a slice of its intermediate dim)
or expert parallelism (ep_size == tp_size: rank r holds experts [r E/ep, (r+1) E/ep)
whole). EP rank and TP rank are the same number, over the same communicator.

A `ParallelContext` is a value handed to every layer constructor (through the
model's `LayerContext`); nothing here is process-wide. The communicator is the
seam for torch.distributed (`forward/distributed.py`): at tp_size 1 there is none
and `all_reduce` and `all_gather` are the identity (the same tensor back, no copy).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from gyrfalcon.config.sharding import (
    ExpertShard,
    HeadShard,
    VocabShard,
    even_shard,
    shard_experts,
    shard_heads,
    shard_vocab,
)

if TYPE_CHECKING:
    import torch


class Communicator(Protocol):
    """The collectives of one TP group (torch.distributed, or a fake in tests)."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of x over the group's ranks (may reuse x's storage)."""
        ...

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] of every rank (the same shape on each), concatenated in rank order
        along the last dim: [..., group size * n], a new tensor."""
        ...

    # set while every rank brings the same number of rows (`ParallelContext.rows_agreed`):
    # all_gather_rows then exchanges no counts
    equal_rows: bool
    # set for one eager forward (`ParallelContext.counts_once`): all_gather_rows may keep
    # the counts it first exchanged for every later call until it is cleared
    keep_counts: bool

    def all_gather_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """(x [n_r, ...] of every rank, padded with zero rows to the most rows R of any
        rank, in rank order along dim 0: [size R, ...], [n_0, n_1, ...]); the ranks' row
        counts may differ (0 included), the other dims may not. A new tensor, except
        that a group of one may return x itself."""
        ...

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's block of the elementwise sum over the group's ranks of x [size n,
        ...] (the same shape on each): rows [rank n, (rank + 1) n) of the sum, [n, ...]."""
        ...


@dataclass(frozen=True)
class ParallelContext:
    """This rank's place in its tensor-parallel group, and the group's collectives."""

    tp_rank: int = 0
    tp_size: int = 1
    comm: Communicator | None = None  # needed when tp_size > 1
    # MoE layers: 1 = MoE-TP (experts' intermediate dim split over the group); tp_size =
    # expert parallelism (each rank holds E / tp experts whole, EP rank = tp_rank)
    ep_size: int = 1
    # DP attention: the group MoE layers split their experts over when it spans the DP
    # groups (every rank of the world); its ranks bring their own tokens (`moe_group`)
    expert: ParallelContext | None = None

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp rank {self.tp_rank} is not in a group of {self.tp_size}")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(
                f"ep size {self.ep_size} is neither 1 nor the tp size {self.tp_size}: "
                "experts split over the ranks of the TP group"
            )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the TP group: x itself at tp_size 1."""
        if self.tp_size == 1:
            return x
        return self._comm("all-reduce").all_reduce(x)

    def reduce_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rmsnorm(s + residual), s + residual), in place in (x, residual), where s is
        the sum of x over the TP group, in one fused step where the communicator has one
        for x (`all_reduce_add_rmsnorm`, an optional method); None otherwise (the caller
        reduces, then adds and norms)."""
        if self.tp_size == 1:
            return None
        fused = getattr(self._comm("all-reduce"), "all_reduce_add_rmsnorm", None)
        return None if fused is None else fused(x, residual, weight, eps)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] of every TP rank concatenated in rank order: [..., tp * n]; x itself
        at tp_size 1."""
        if self.tp_size == 1:
            return x
        return self._comm("all-gather").all_gather(x)

    def all_gather_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """(x [n_r, ...] of every TP rank padded to the most rows R, in rank order along
        dim 0: [tp R, ...], each rank's n_r): the row counts may differ. (x, [n]) at
        tp_size 1."""
        if self.tp_size == 1:
            return x, [x.shape[0]]
        return self._comm("all-gather rows").all_gather_rows(x)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This TP rank's block of the sum over the group of x [tp n, ...]: [n, ...]; x
        itself at tp_size 1."""
        if self.tp_size == 1:
            return x
        return self._comm("reduce-scatter").reduce_scatter(x)

    def _comm(self, what: str) -> Communicator:
        if self.comm is None:
            raise RuntimeError(f"tp size {self.tp_size} needs a communicator to {what}")
        return self.comm

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadShard:
        """This rank's attention heads (`shard_heads`)."""
        return shard_heads(num_heads, num_kv_heads, self.tp_rank, self.tp_size)

    def even_shard(self, size: int) -> tuple[int, int]:
        """(start, length) of this rank's even part of `size` (`even_shard`)."""
        return even_shard(size, self.tp_rank, self.tp_size)

    def vocab(self, vocab_size: int) -> VocabShard:
        """This rank's vocabulary rows (`shard_vocab`)."""
        return shard_vocab(vocab_size, self.tp_rank, self.tp_size)

    @property
    def moe_group(self) -> tuple[ParallelContext, bool]:
        """(the group MoE layers shard and combine over, whether its ranks hold their
        own tokens): the TP group, whose ranks share theirs, unless DP attention gave
        the experts a group of their own across the DP groups."""
        if self.expert is None:
            return self, False
        return self.expert, True

    def rows_agreed(self) -> contextlib.AbstractContextManager[None]:
        """Inside: every rank of the MoE group brings the same number of token rows (the
        DP ranks replay graphs padded to one agreed batch size), so the MoE layers'
        gather of every rank's tokens needs no host exchange of row counts, and CUDA
        graphs capture it. A no-op where the MoE group shares its tokens."""
        return self._rows_gather_set("equal_rows")

    def counts_once(self) -> contextlib.AbstractContextManager[None]:
        """Inside: one eager forward, whose MoE layers all gather the same rows from each
        rank, so their row counts are exchanged once, by the first layer, instead of in
        every layer: one host sync a forward, not one a layer (each one had the host wait
        for the device before it could launch the next layer's kernels). A no-op where
        the MoE group shares its tokens."""
        return self._rows_gather_set("keep_counts")

    @contextlib.contextmanager
    def _rows_gather_set(self, flag: str) -> Iterator[None]:
        """Inside: `flag` set on the communicator that gathers the MoE group's own
        tokens (restored after); a no-op where the MoE group shares its tokens."""
        group, local = self.moe_group
        comm = group.comm if local and group.tp_size > 1 else None
        if comm is None:
            yield
            return
        before = getattr(comm, flag)
        setattr(comm, flag, True)
        try:
            yield
        finally:
            setattr(comm, flag, before)

    def experts(self, num_experts: int, intermediate_size: int) -> ExpertShard:
        """This rank's experts and slice of their intermediate dim (`shard_experts`)."""
        return shard_experts(
            num_experts, intermediate_size, self.tp_rank, self.tp_size, self.ep_size
        )


SINGLE_RANK = ParallelContext()
