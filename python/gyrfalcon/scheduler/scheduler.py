"""Scheduler: request lifecycle, step plans, results -> outputs.

A composition of small parts: the page allocator, the step policy, and the
request table. It never touches tensors.

Overlap scheduling: up to `max_inflight` plans are out at once. A plan applies
its decision when it is built (see request.py); results come back in plan
order. A request that finishes on a result may still have a row in a later
plan in flight: that row's result is dropped, and its pages, freed at once,
are only reused by plans the worker runs after it.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.ipc.contract import pages_needed
from gyrfalcon.ipc.messages import (
    ForwardMode,
    GenerateRequest,
    NewRequest,
    RankBatch,
    RequestOutput,
    ScheduledRow,
    StatsReply,
    StepPlan,
    StepResult,
)
from gyrfalcon.scheduler.page_allocator import PageAllocator
from gyrfalcon.scheduler.policy import Decision, Limits, ReserveRatio, schedule
from gyrfalcon.scheduler.request import Request, Status
from gyrfalcon.scheduler.step_log import StepCounters, is_decode_row


@dataclass(frozen=True)
class SchedulerConfig:
    num_pages: int
    page_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill_size: int
    eos_token_ids: tuple[int, ...]
    check_invariants: bool = False
    max_inflight: int = 1  # plans out at once; 2 overlaps planning with execution
    conservativeness: float = 1.0  # scales the admission reserve (ReserveRatio.scaled)

    @classmethod
    def from_args(
        cls,
        args: ServerArgs,
        num_pages: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        check_invariants: bool | None = None,
    ) -> SchedulerConfig:
        """The scheduler's limits from resolved server args and what the worker sized."""
        check = args.check_invariants if check_invariants is None else check_invariants
        if args.schedule_conservativeness < 0:
            raise ValueError("--schedule-conservativeness must be >= 0")
        return cls(
            num_pages=num_pages,
            page_size=args.page_size,
            max_model_len=max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            chunked_prefill_size=args.chunked_prefill_size,
            eos_token_ids=eos_token_ids,
            check_invariants=check,
            max_inflight=1 if args.disable_overlap_schedule else 2,
            conservativeness=args.schedule_conservativeness,
        )


def forward_mode(decision: Decision) -> ForwardMode:
    decodes = sum(1 for s in decision.rows if is_decode_row(s.num_tokens, s.req.num_generated))
    if decodes == len(decision.rows):
        return ForwardMode.DECODE
    return ForwardMode.PREFILL if decodes == 0 else ForwardMode.MIXED


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.alloc = PageAllocator(cfg.num_pages)
        self.limits = Limits(
            cfg.max_num_batched_tokens,
            cfg.chunked_prefill_size,
            cfg.max_num_seqs,
            cfg.page_size,
            cfg.max_model_len,
        )
        self.reserve = ReserveRatio.scaled(cfg.conservativeness)
        self.requests: dict[str, Request] = {}
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self._arrivals = itertools.count()
        self._steps = itertools.count()
        self._finished_for_worker: list[str] = []
        self._outputs: list[RequestOutput] = []
        self._inflight: deque[tuple[int, Decision]] = deque()  # (step_id, decision), in order
        self.counters = StepCounters()

    # ------------------------------------------------------------ inputs

    def add_request(self, msg: GenerateRequest) -> None:
        req = Request(msg.rid, list(msg.prompt_ids), msg.sampling, next(self._arrivals))
        if msg.rid in self.requests:
            self._outputs.append(self._final(req, "error", "duplicate request id"))
            return
        n = len(req.prompt_ids)
        if n == 0:
            self._outputs.append(self._final(req, "error", "empty prompt"))
            return
        if n >= self.cfg.max_model_len:
            err = f"prompt has {n} tokens; the context length is {self.cfg.max_model_len}"
            self._outputs.append(self._final(req, "error", err))
            return
        self.requests[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is not None:
            self._finish(req, "abort")

    # ------------------------------------------------------------ steps

    def has_work(self) -> bool:
        """Requests to run, results to wait for, or finished requests the worker holds."""
        return bool(self.running or self.waiting or self._inflight or self._finished_for_worker)

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def may_plan(self) -> bool:
        """Whether another plan may go out before the oldest result is back."""
        return len(self._inflight) < self.cfg.max_inflight

    def build_plan(self) -> StepPlan | None:
        """Plan the next step and apply it to request state; None if nothing to send."""
        assert self.may_plan(), "too many plans in flight"
        decision = schedule(self.running, self.waiting, self.alloc, self.limits, self.reserve.value)
        self.reserve.update(decision)
        if not decision.rows and not self._finished_for_worker:
            return None
        new_requests, rows = [], []
        for s in decision.rows:
            req = s.req
            if not req.sent_to_worker:
                new_requests.append(NewRequest(req.rid, req.prompt_ids, req.sampling))
                req.sent_to_worker = True
            start = req.num_computed
            rows.append(
                ScheduledRow(
                    rid=req.rid,
                    start=start,
                    input_ids=req.tokens_slice(start, start + s.num_tokens),
                    new_pages=s.new_pages,
                    sample=s.samples,
                    reset=s.reset,
                )
            )
        mode = forward_mode(decision)
        self.counters.add(decision)
        for s in decision.rows:  # the plan's effect, applied now (see request.py)
            s.req.num_computed += s.num_tokens
            s.req.num_pending += s.samples
        batches = [RankBatch(mode, rows)] if rows else [RankBatch(ForwardMode.IDLE, [])]
        plan = StepPlan(next(self._steps), new_requests, self._finished_for_worker, batches)
        self._finished_for_worker = []
        self._inflight.append((plan.step_id, decision))
        return plan

    def pump(
        self, submit: Callable[[StepPlan], None], receive: Callable[[], StepResult]
    ) -> list[RequestOutput]:
        """One turn of the step pipeline; returns outputs for the frontend.

        Sends a plan if one may go out and there is one; then waits for the oldest
        result if no further plan may go out, or if there was nothing to plan.
        """
        outputs = self.take_outputs()
        plan = self.build_plan() if self.may_plan() else None
        if plan is not None:
            submit(plan)
        if self._inflight and (plan is None or not self.may_plan()):
            outputs += self.process_result(receive())
        return outputs

    def process_result(self, result: StepResult) -> list[RequestOutput]:
        """Apply the oldest plan's result; return outputs for the frontend."""
        step_id, decision = self._inflight.popleft()
        assert result.step_id == step_id, f"result of step {result.step_id}, expected {step_id}"
        by_rid = {r.rid: r for r in result.rows}
        for s in decision.rows:
            req = s.req
            if req.status is Status.FINISHED:  # finished or aborted while the step ran
                continue
            row = by_rid[req.rid]
            if row.prompt_logprobs is not None and not req.prompt_logprobs_sent:
                if req.prompt_logprobs is None:
                    req.prompt_logprobs = [None]
                # NOTE: a recompute after preemption repeats positions already held
                if len(req.prompt_logprobs) == s.start + 1:
                    req.prompt_logprobs.extend(row.prompt_logprobs)
            if not s.samples:
                continue
            assert row.token_id >= 0, f"row {req.rid} should have sampled"
            req.num_pending -= 1
            req.output_ids.append(row.token_id)
            if row.logprobs is not None:
                req.pending_logprobs.append(row.logprobs)
            reason = self._stop_reason(req, row.token_id)
            if reason is not None:
                self._finish(req, reason)
            else:
                self._outputs.append(self._delta(req))
        if self.cfg.check_invariants:
            self.check_integrity()
        return self.take_outputs()

    def take_outputs(self) -> list[RequestOutput]:
        out, self._outputs = self._outputs, []
        return out

    # ------------------------------------------------------------ finishing

    def _stop_reason(self, req: Request, token: int) -> str | None:
        sp = req.sampling
        # NOTE: the sampler masks stop tokens under min_tokens; this keeps the rule
        # even when nothing else could be sampled (allowed_token_ids = a stop id).
        may_stop = len(req.output_ids) > sp.min_tokens
        if may_stop and token in sp.stop_token_ids:
            return "stop"
        if may_stop and not sp.ignore_eos and token in self.cfg.eos_token_ids:
            return "stop"
        known = len(req.prompt_ids) + len(req.output_ids)  # NOTE: not counting tokens in flight
        if len(req.output_ids) >= sp.max_tokens or known >= self.cfg.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self.alloc.free(req.pages)
        req.pages = []
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req.sent_to_worker:
            self._finished_for_worker.append(req.rid)
        del self.requests[req.rid]
        out = self._delta(req)
        out.error = error
        self._outputs.append(out)

    def _final(self, req: Request, reason: str, error: str) -> RequestOutput:
        return RequestOutput(
            rid=req.rid,
            token_ids=[],
            finish_reason=reason,
            num_prompt_tokens=len(req.prompt_ids),
            error=error,
        )

    def _delta(self, req: Request) -> RequestOutput:
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
        )

    def fail_all(self, message: str) -> list[RequestOutput]:
        for req in list(self.requests.values()):
            self._finish(req, "error", message)
        return self.take_outputs()

    # ------------------------------------------------------------ introspection

    def check_integrity(self) -> None:
        self.alloc.check_integrity(r.pages for r in self.requests.values())
        for req in self.running:
            assert req.status is Status.RUNNING
            assert pages_needed(len(req.pages), req.num_computed, self.cfg.page_size) == 0

    def stats(self, nonce: int) -> StatsReply:
        ok, err = True, None
        try:
            self.check_integrity()
        except AssertionError as e:
            ok, err = False, str(e) or "integrity check failed"
        return StatsReply(
            nonce=nonce,
            num_total_pages=self.alloc.num_usable,
            num_free_pages=self.alloc.num_free,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            integrity_ok=ok,
            integrity_error=err,
        )
