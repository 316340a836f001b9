"""Which rows of a padded training batch the loss reads, from the lengths alone.

Row p of unroll step j predicts the token t = p + 2 + j (`ttt`), scored by the target's
logits at position t - 1, and counts while t is an answer token that exists:
prompt_len <= t < length. Over the steps j < k these rows are p in
[max(0, prompt_len - 1 - k), length - 3] (their union; none without an answer token);
the target positions that score them are q in [prompt_len - 1, length - 2], one per
answer token. Both are built on the
host from the lengths (a `nonzero` over a device mask would stop the host at every
unroll step), and each step picks its own rows out of the union on the device
(`ScoredRows.at_step`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def ranges(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(owner, value) over the concatenated ranges [lo[i], hi[i]) (empty where hi <= lo):
    value runs through each range in order, owner is its i. CPU int64 tensors."""
    counts = (hi - lo).clamp(min=0)
    owner = torch.repeat_interleave(torch.arange(len(lo)), counts)
    offsets = torch.cumsum(counts, 0) - counts
    value = torch.arange(int(counts.sum())) - offsets[owner] + lo[owner]
    return owner, value


@dataclass
class RowPlan:
    """The host's index lists for a batch (CPU int64)."""

    seq: torch.Tensor  # [n] the sequence of each union row
    pos: torch.Tensor  # [n] its position p
    target_seq: torch.Tensor  # [m] the sequence of each scoring target position
    target_pos: torch.Tensor  # [m] its position q
    target_start: torch.Tensor  # [B] the index in target_* of each sequence's first q
    prompt_lens: torch.Tensor  # [B]
    lengths: torch.Tensor  # [B]

    def row_arrays(self, seq_len: int) -> list[torch.Tensor]:
        """`ScoredRows`' fields in order, per union row, for a batch padded to seq_len."""
        return [
            self.seq * seq_len + self.pos,
            self.seq,
            self.pos,
            self.prompt_lens[self.seq],
            self.lengths[self.seq],
            (self.target_start - self.prompt_lens)[self.seq],
        ]


def plan_rows(lengths: Sequence[int], prompt_lens: Sequence[int], steps: int) -> RowPlan:
    """The union rows of `steps` unroll steps and the target positions (module docstring)."""
    n = torch.tensor(lengths, dtype=torch.int64)
    p = torch.tensor(prompt_lens, dtype=torch.int64)
    assert len(n) == len(p), (lengths, prompt_lens)
    assert bool((p >= 1).all()) and bool((p <= n).all()), (lengths, prompt_lens)
    lo = (p - 1 - steps).clamp(min=0)
    seq, pos = ranges(lo, torch.where(p < n, n - 2, lo))  # NOTE: no answer token, no row
    target_seq, target_pos = ranges(p - 1, n - 1)
    counts = n - p
    return RowPlan(seq, pos, target_seq, target_pos, torch.cumsum(counts, 0) - counts, p, n)


@dataclass
class ScoredRows:
    """A batch's union rows (`RowPlan.row_arrays`, on the device), each with what its
    sequence says about it: every step picks its rows and their scoring positions with
    elementwise ops alone."""

    flat: torch.Tensor  # [n] int64: b * S + p, the row in a flattened [B, S] batch
    seq: torch.Tensor  # [n] int64: b
    pos: torch.Tensor  # [n] int64: p
    first: torch.Tensor  # [n] int64: the sequence's prompt length (its first answer token)
    end: torch.Tensor  # [n] int64: the sequence's length
    base: torch.Tensor  # [n] int64: the target arrays' row of the sequence's token t is base + t

    def at_step(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(valid [n] bool: the row predicts an answer token that exists at this step,
        target_row [n]: the target array's row that scores it; 0 where not valid)."""
        t = self.pos + 2 + step
        valid = (t >= self.first) & (t < self.end)
        return valid, torch.where(valid, self.base + t, 0)
