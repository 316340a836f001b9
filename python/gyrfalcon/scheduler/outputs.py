"""Request state -> the `RequestOutput` deltas the frontend receives."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import chain, zip_longest

from gyrfalcon.ipc.messages import RequestOutput
from gyrfalcon.scheduler.request import Request


def final_output(req: Request, reason: str, error: str, status: int = 0) -> RequestOutput:
    """The one output of a request refused before it ran (`status`: RequestOutput's
    error_status)."""
    return RequestOutput(
        rid=req.rid,
        token_ids=[],
        finish_reason=reason,
        num_prompt_tokens=len(req.prompt_ids),
        error=error,
        error_status=status,
    )


def delta_output(req: Request) -> RequestOutput:
    """What req produced since its last output (marks it sent)."""
    new = req.output_ids[req.num_sent :]
    req.num_sent = len(req.output_ids)
    logprobs = None
    if req.sampling.logprobs is not None:
        logprobs, req.pending_logprobs = req.pending_logprobs, []
    prompt_lp = None
    if (
        req.sampling.prompt_logprobs is not None
        and not req.prompt_logprobs_sent
        and (req.output_ids or req.finish_reason)
    ):
        prompt_lp = req.prompt_logprobs or [None]
        req.prompt_logprobs_sent = True
    return RequestOutput(
        rid=req.rid,
        token_ids=new,
        logprobs=logprobs,
        prompt_logprobs=prompt_lp,
        finish_reason=req.finish_reason,
        num_prompt_tokens=len(req.prompt_ids),
        num_output_tokens=len(req.output_ids),
        num_verify_steps=req.num_verify_steps,
        num_accepted=req.num_accepted,
        num_cached_tokens=req.num_cached_tokens,
    )


def interleave(per_rank: Sequence[list[RequestOutput]]) -> list[RequestOutput]:
    """The outputs of one step's DP ranks, one of each rank in turn: [a0, b0, a1, b1, a2].

    Why: clients answer in the order outputs reach them. Requests that end in one step
    on both ranks (chats in lock-step) come back as next turns, and each next turn is
    routed to the rank holding its earlier turns within a slack of the least loaded
    (ranks.pick_rank). Rank 0's finishes all first would send rank 0's next turns in a
    run, and every one past the slack would go to the other rank and compute its
    whole conversation again."""
    return [o for o in chain.from_iterable(zip_longest(*per_rank)) if o is not None]
