"""Scheduler-side request state and the one token-accounting rule.

tokens      = prompt_ids + output_ids
num_computed = tokens whose KV is written and valid
a request is in decode when num_computed == len(tokens) - 1
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

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
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        return (self.prompt_ids + self.output_ids)[start:end]

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next sample."""
        return self.num_tokens - self.num_computed

    @property
    def in_decode(self) -> bool:
        return self.remaining == 1 and len(self.output_ids) > 0
