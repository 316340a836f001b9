"""Token embedding and LM head, split by vocabulary rows over the TP ranks.

Each rank holds the rows `ParallelContext.vocab` gives it (`shard_vocab`: ceil(V /
tp) rows, the last rank's tail zero padding when tp does not divide V) and loads
them from the full HF tensor. The embedding looks up the ids it holds, zeros for
the others, and all-reduces: exactly one rank contributes each row, so every rank
gets the single rank's embedding bit for bit. The LM head multiplies by its rows
and all-gathers the logits, the padding columns dropped, so every rank gets all
[N, vocab] logits and sampling stays as at tp 1. A tied LM head reads its
embedding's (sharded) weight.

NOTE: at tp 1 both are what they were before the split: one full [V, H] weight,
one F.embedding / F.linear, no collective and no copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gyrfalcon.config.sharding import VocabShard
from gyrfalcon.layers.context import LayerContext


def load_vocab_rows(
    weight: torch.Tensor, loaded: torch.Tensor, shard: VocabShard, vocab_size: int
) -> None:
    """Copy this rank's rows of a full [vocab, H] checkpoint tensor into `weight`
    [shard.num_rows, H]; its padding rows are zeroed."""
    want = (vocab_size, weight.shape[1])
    if tuple(loaded.shape) != want:
        raise ValueError(f"vocabulary tensor is {list(loaded.shape)}, expected {list(want)}")
    n = shard.num_ids
    weight.data[:n].copy_(loaded.narrow(0, shard.start, n))
    weight.data[n:].zero_()


class VocabEmbedding(nn.Module):
    """ids -> embeddings, the table split by vocabulary rows over the TP group."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: LayerContext):
        super().__init__()
        self.parallel = ctx.parallel
        self.vocab_size = vocab_size
        self.shard = ctx.parallel.vocab(vocab_size)
        self.weight = nn.Parameter(
            torch.empty(self.shard.num_rows, hidden_size), requires_grad=False
        )

    def load(self, name: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        assert name == "weight" and shard_id is None, (name, shard_id)
        load_vocab_rows(self.weight, loaded, self.shard, self.vocab_size)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, hidden]
        if self.parallel.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.shard.start
        elsewhere = (local < 0) | (local >= self.shard.num_ids)  # [T] held by another rank
        out = F.embedding(local.masked_fill(elsewhere, 0), self.weight)
        # NOTE: masked_fill, not a multiply by the mask: row 0 may be padding on a rank
        # that holds no ids, and zeroing never turns a stray value into a NaN
        out.masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.parallel.all_reduce(out)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits, split by vocabulary rows over the TP
    group; may share the (equally split) embedding weight."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        ctx: LayerContext,
        tied: VocabEmbedding | None = None,
    ):
        super().__init__()
        self.parallel = ctx.parallel
        self.vocab_size = vocab_size
        self.shard = ctx.parallel.vocab(vocab_size)
        self.tied = tied
        if tied is None:
            self.weight = nn.Parameter(
                torch.empty(self.shard.num_rows, hidden_size), requires_grad=False
            )
        else:
            assert tied.shard == self.shard, (tied.shard, self.shard)

    def load(self, name: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        assert name == "weight" and shard_id is None, (name, shard_id)
        if self.tied is None:
            load_vocab_rows(self.weight, loaded, self.shard, self.vocab_size)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The weight rows of token ids [n] -> [n, H] (one rank holding the whole
        vocabulary): the logits at those ids alone are F.linear(hidden, rows(ids))."""
        assert self.parallel.tp_size == 1, "the rows of a vocabulary split over ranks"
        weight = self.tied.weight if self.tied is not None else self.weight
        return weight[ids]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> logits [N, V]
        weight = self.tied.weight if self.tied is not None else self.weight
        logits = F.linear(hidden, weight)  # [N, V / tp rows of this rank]
        if self.parallel.tp_size == 1:
            return logits
        logits = self.parallel.all_gather(logits)  # [N, padded V], ranks in order
        if self.shard.padded_vocab == self.vocab_size:
            return logits
        # NOTE: contiguous, as the sampler and the graphs' static outputs expect; a copy
        # only when tp does not divide the vocabulary
        return logits[..., : self.vocab_size].contiguous()
