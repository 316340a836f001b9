"""Request state -> the `RequestOutput` deltas the frontend receives."""

from __future__ import annotations

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
