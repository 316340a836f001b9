"""Token embedding and LM head.

NOTE: replicated on every TP rank for now; the vocab-parallel split comes with the
parallelism work, which is why they take the layer context already (unused today).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gyrfalcon.layers.context import LayerContext


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, ctx: LayerContext):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def load(self, name: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        self.weight.data.copy_(loaded)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, hidden]
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits; may share the embedding weight."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        ctx: LayerContext,
        tied: VocabEmbedding | None = None,
    ):
        super().__init__()
        self.tied = tied
        if tied is None:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def load(self, name: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        if self.tied is None:
            self.weight.data.copy_(loaded)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, H] -> logits [N, V]
        weight = self.tied.weight if self.tied is not None else self.weight
        return F.linear(hidden, weight)
