"""Scheduler-side request state and the one token-accounting rule.

tokens       = prompt_ids + output_ids + num_pending placeholders
num_pending  = sampling rows in flight (each will emit at least one token; only
               that first token is counted, as a PLACEHOLDER, until it is back)
num_computed = tokens whose KV is written (or will be, by a step in flight)
a request is in decode when num_computed == len(tokens) - 1

A step only decides how far each request advances. A row starts at
s = num_computed with n input tokens; planning it applies its effect at once
(overlap scheduling plans the next step before this one's result is back):

    num_computed += n;  num_pending += 1 if the row samples

A sampling row may also carry d draft slots (speculative decoding; d = 0 without
it): the worker appends d draft tokens of its own after the input and writes
their KV, so the row holds pages for positions [s, kv_end(s, n, d)). The draft
tokens never reach the scheduler. The row emits a + 1 tokens (0 <= a <= d): the
a drafts the target accepted and one token of the target, at positions
s + n .. s + n + a. When the result arrives:

    num_pending -= 1;  output_ids += the emitted tokens, cut at a finish;
    num_computed += a  (the accepted drafts' KV is valid; rejected slots are
                        simply overwritten later)

so the request is in decode again: its last emitted token, at position
s + n + a, is the next row's input. Emitted tokens are checked in order (stop
ids, EOS, max_tokens, min_tokens, context length); the output ends at the first
one that finishes the request and the tokens after it are dropped, never counted
(`cut_at_finish`).

A pending token is fed to the next step as PLACEHOLDER; the worker substitutes
the last token it emitted for that request, on the device. While a row in flight
may emit several tokens (num_pending_drafts > 0), num_computed is a lower bound:
the next row, if planned before that result (a floating row, policy.floats),
starts at num_computed + (drafts the row in flight accepts), a position the
worker knows on the device only (it starts the row where the previous one ended),
and holds pages for the latest start, num_computed + num_pending_drafts. The
`num_computed += a` above then makes the bound exact again.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
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
    dp_rank: int = 0  # the DP rank that runs it, fixed when it arrives
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_pending: int = 0  # sampling rows in flight (see the module docstring)
    num_pending_drafts: int = 0  # draft slots of those rows: > 0 = num_computed is a bound
    pages: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    sent_to_worker: bool = False
    needs_reset: bool = False  # preempted: worker must drop its page table
    num_sent: int = 0  # output tokens already sent to the frontend
    pending_logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    prompt_logprobs_sent: bool = False
    num_verify_steps: int = 0  # sampling rows that verified drafts (speculative decoding)
    num_accepted: int = 0  # drafts those rows accepted
    # prefix caching (prefix_cache.py): tokens found cached at first admission, the
    # cache node of its last page in the cache's tree and how many of its pages that is
    num_cached_tokens: int = 0
    cache_node: int = 0
    num_cache_pages: int = 0

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
        # NOTE: not prompt + outputs whole: a decode row's slice would copy its context
        if start >= n:
            ids = self.output_ids[start - n : end - n]
        else:
            ids = self.prompt_ids[start:] + self.output_ids[: end - n]
        return ids + [PLACEHOLDER] * (end - max(start, n + len(self.output_ids)))

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next sample."""
        return self.num_tokens - self.num_computed

    @property
    def in_decode(self) -> bool:
        return self.remaining == 1 and self.num_generated > 0

    def tokens_left(self, max_model_len: int) -> int:
        """Output tokens it may still get, counting tokens in flight."""
        return min(self.sampling.max_tokens - self.num_generated, self.room(max_model_len))

    def room(self, max_model_len: int) -> int:
        """Positions left in the context, counting tokens in flight."""
        return max_model_len - self.num_tokens


# ---------------------------------------------------------------- index math


def kv_end(start: int, num_tokens: int, num_draft: int = 0) -> int:
    """End of the KV positions a row writes: its inputs [start, start + num_tokens),
    then the worker's num_draft draft tokens after them."""
    return start + num_tokens + num_draft


def draft_slots(num_draft: int, room: int) -> int:
    """Draft slots of a decode row with `room` positions left in the context (>= 1):
    the configured count, but none whose KV would pass the context's end (a row
    writes its input and its drafts). Not capped by max_tokens: tokens past it are
    dropped when the result comes back (`cut_at_finish`), and rows of one size keep
    a step in one CUDA graph (worker/spec_step_graph.py)."""
    return max(0, min(num_draft, room - 1))


def stop_reason(
    sp: SamplingParams,
    token: int,
    num_output: int,
    num_known: int,
    eos_token_ids: Sequence[int],
    max_model_len: int,
) -> str | None:
    """Why the output ends at `token`, its num_output-th output token, which makes
    the sequence num_known tokens long; None if it goes on."""
    # NOTE: the sampler masks stop tokens under min_tokens; this keeps the rule
    # even when nothing else could be sampled (allowed_token_ids = a stop id).
    may_stop = num_output > sp.min_tokens
    if may_stop and token in sp.stop_token_ids:
        return "stop"
    if may_stop and not sp.ignore_eos and token in eos_token_ids:
        return "stop"
    if num_output >= sp.max_tokens or num_known >= max_model_len:
        return "length"
    return None


def cut_at_finish(
    req: Request, emitted: Sequence[int], eos_token_ids: Sequence[int], max_model_len: int
) -> tuple[int, str | None]:
    """How many of a row's emitted tokens join req's output, and the finish reason
    if one of them ends it: tokens are checked in order and the output is cut after
    the first that finishes the request."""
    num_output = len(req.output_ids)
    num_known = len(req.prompt_ids) + num_output  # NOTE: not counting tokens in flight
    for i, token in enumerate(emitted, 1):
        reason = stop_reason(
            req.sampling, token, num_output + i, num_known + i, eos_token_ids, max_model_len
        )
        if reason is not None:
            return i, reason
    return len(emitted), None
