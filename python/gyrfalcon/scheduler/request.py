"""Scheduler-side request state and the one token-accounting rule.

tokens       = prompt_ids + output_ids + num_pending placeholders
num_pending  = tokens sampled by steps in flight whose value is not back yet
num_computed = tokens whose KV is written (or will be, by a step in flight)
a request is in decode when num_computed == len(tokens) - 1

With overlap scheduling the next step is planned before the previous one's
result arrives: a planned step advances num_computed at once, and a sampling
row adds a pending token. A pending token is fed to the next step as
PLACEHOLDER; the worker substitutes the id it sampled, on the device.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from gyrfalcon.ipc.contract import PLACEHOLDER
from gyrfalcon.ipc.messages import PositionLogprobs, SamplingParams


class Status(enum.Enum):
    WAITING = 1
    RUNNING = 2
    FINISHED = 3


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival: int  # monotonically increasing admission order
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_pending: int = 0  # sampled tokens in flight (see the module docstring)
    pages: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    sent_to_worker: bool = False
    needs_reset: bool = False  # preempted: worker must drop its page table
    num_sent: int = 0  # output tokens already sent to the frontend
    pending_logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.num_pending

    @property
    def num_generated(self) -> int:
        """Output tokens, known or in flight."""
        return len(self.output_ids) + self.num_pending

    def tokens_slice(self, start: int, end: int) -> list[int]:
        """Token ids of positions [start, end); in-flight tokens are PLACEHOLDER."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        known = self.prompt_ids + self.output_ids
        return known[start:end] + [PLACEHOLDER] * (end - max(start, len(known)))

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next sample."""
        return self.num_tokens - self.num_computed

    @property
    def in_decode(self) -> bool:
        return self.remaining == 1 and self.num_generated > 0
