"""Values and index math both ends of the scheduler -> worker edge rely on.

The scheduler plans with them and the worker executes with them; neither side
imports the other, so they live here, beside the messages they describe.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gyrfalcon.ipc.messages import SamplingParams, ScheduledRow

# Input id of a position whose token is still being sampled by a step in flight:
# the worker substitutes the id it sampled, on the device.
PLACEHOLDER = -1

# The reserved KV page: never handed to a request; padded and dummy rows read and
# write only this page, so a padded batch needs no KV capacity beyond it.
DUMMY_PAGE = 0


def piecewise_sizes(max_tokens: int) -> list[int]:
    """The token counts piecewise graphs are captured at (worker/piecewise_graph.py),
    ascending: 16, 32, 64, then steps of half the power of two <= the size (96, 128,
    192, 256, 384, 512, 768; at most 1.5x padding above 64 tokens), from 1,024 steps of
    an eighth of it (1,024, 1,152, ..., 2,048, 2,304, ...; at most 1.125x: a large step
    may be GPU-bound, where padding costs its share of the step), up to max_tokens
    (included); [] when max_tokens < 1. The scheduler pads DP ranks' agreed token
    counts to them (`StepPlan.graph_tokens`)."""
    if max_tokens < 1:
        return []
    sizes, size = [], 16
    while size < max_tokens:
        sizes.append(size)
        power = 1 << (size.bit_length() - 1)  # NOTE: the power of two <= size
        size = size * 2 if size < 64 else size + (power // 2 if size < 1024 else power // 8)
    return sorted(set(sizes) | {max_tokens})


def step_tokens(rows: Sequence[ScheduledRow]) -> int:
    """The tokens a rank's batch runs through the target: each row's input ids and its
    draft slots (an IDLE batch: 0; its dummy row is the worker's)."""
    return sum(len(row.input_ids) + row.num_draft for row in rows)


def pages_needed(pages_held: int, end: int, page_size: int) -> int:
    """Extra pages for KV positions [0, end) given pages already held."""
    return max(0, -(-end // page_size) - pages_held)


@dataclass(frozen=True)
class RankLayout:
    """The worker ranks and the DP groups they form.

    Rank r is TP rank `r % tp_size` of DP group `r // tp_size`. Every rank receives
    every plan and runs its DP group's `RankBatch`; the group's TP rank 0 alone
    returns the group's `StepResult`. `--dp-size` and `--tp-size` set the sizes
    (one worker, which runs batch 0 and reports, by default).
    """

    dp_size: int = 1
    tp_size: int = 1

    def __post_init__(self) -> None:
        assert self.dp_size >= 1 and self.tp_size >= 1, self

    @property
    def world_size(self) -> int:
        return self.dp_size * self.tp_size

    def dp_rank(self, rank: int) -> int:
        assert 0 <= rank < self.world_size, (rank, self)
        return rank // self.tp_size

    def reports(self, rank: int) -> bool:
        """Whether `rank` returns its DP group's results."""
        return rank % self.tp_size == 0


def verifies_drafts(params: SamplingParams) -> bool:
    """Whether a request's decode rows verify drafts when speculative decoding is on.

    NOTE: penalties make position j's distribution depend on the tokens accepted
    before it in the same step; those requests decode one token per step instead,
    which is exactly what they would get without speculation.
    """
    return (
        params.repetition_penalty == 1.0
        and params.presence_penalty == 0.0
        and params.frequency_penalty == 0.0
    )


def is_steady_verify_row(row: ScheduledRow, num_draft: int) -> bool:
    """Whether a row is a steady-state verify row: one input token then all `num_draft`
    drafts, num_draft + 1 tokens (the width of the VERIFY graphs and of the fused step)."""
    return len(row.input_ids) == 1 and row.num_draft == num_draft
