"""Scheduler: request lifecycle, step plans, results -> outputs.

A composition of small parts: the step policy, the request table and, per DP
rank, a page allocator and queues (`ranks.RankState`). It never touches tensors.

Overlap scheduling: up to `max_inflight` plans are out at once. A plan applies
its decision when it is built (see request.py); each rank's results come back
in plan order. A request that finishes on a result may still have a row in a
later plan in flight: that row's result is dropped, and its pages, freed at
once, are only reused by plans the worker runs after it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus

from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.ipc.contract import pages_needed, piecewise_sizes
from gyrfalcon.ipc.messages import (
    GenerateRequest,
    RequestOutput,
    RowResult,
    StatsReply,
    StepPlan,
    StepResult,
)
from gyrfalcon.scheduler.outputs import delta_output, final_output, interleave
from gyrfalcon.scheduler.page_allocator import PageAllocator
from gyrfalcon.scheduler.plan import agreed_graph, agreed_tokens, rank_batch
from gyrfalcon.scheduler.policy import Limits, ReserveRatio, Scheduled, schedule
from gyrfalcon.scheduler.prefix_cache import PrefixCache
from gyrfalcon.scheduler.ranks import RankState, pick_rank
from gyrfalcon.scheduler.request import Request, Status, cut_at_finish
from gyrfalcon.scheduler.step_log import StepCounters


@dataclass(frozen=True)
class SchedulerConfig:
    num_pages: int  # per DP rank
    page_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    chunked_prefill_size: int
    eos_token_ids: tuple[int, ...]
    check_invariants: bool = False
    max_inflight: int = 1  # plans out at once; 2 overlaps planning with execution
    conservativeness: float = 1.0  # scales the admission reserve (ReserveRatio.scaled)
    dp_size: int = 1  # DP ranks: one RankBatch, page pool and running set each
    num_draft_tokens: int = 0  # draft slots per decode row (speculative decoding; 0 = off)
    float_rows: bool = False  # workers start floating rows on the device (policy.floats)
    max_queue_len: int = 0  # waiting requests beyond which arrivals are refused (0: none)
    prefix_caching: bool = False  # KV pages shared by content (prefix_cache.py)
    separate_prefill: bool = False  # prefill rows never beside decode rows (policy.Limits)
    # the token counts the workers capture piecewise graphs at (DP ranks that agree on
    # graphs pad steps without one to them: `plan.agreed_tokens`); () where none
    piecewise_sizes: tuple[int, ...] = ()

    @classmethod
    def from_args(
        cls,
        args: ServerArgs,
        num_pages: int,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        check_invariants: bool | None = None,
        dp_size: int = 1,
        float_rows: bool = False,
    ) -> SchedulerConfig:
        """The scheduler's limits from resolved server args and what the workers sized."""
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
            dp_size=dp_size,
            num_draft_tokens=args.num_draft_tokens,
            float_rows=float_rows and not args.disable_overlap_schedule,
            max_queue_len=args.max_queue_len or 0,
            prefix_caching=not args.disable_prefix_caching,
            separate_prefill=args.separate_prefill_steps,
            piecewise_sizes=tuple(piecewise_sizes(args.piecewise_cuda_graph_max_tokens))
            if args.graph_mode() is not None
            else (),
        )


class Scheduler:
    def __init__(self, cfg: SchedulerConfig):
        self.cfg = cfg
        self.limits = Limits(
            cfg.max_num_batched_tokens,
            cfg.chunked_prefill_size,
            cfg.max_num_seqs,
            cfg.page_size,
            cfg.max_model_len,
            cfg.num_draft_tokens,
            draft_lookahead=max(0, cfg.num_draft_tokens - 1),
            float_rows=cfg.float_rows,
            separate_prefill=cfg.separate_prefill,
        )
        self.ranks = []
        for r in range(cfg.dp_size):
            alloc = PageAllocator(cfg.num_pages)
            cache = None
            if cfg.prefix_caching:
                cache = PrefixCache(alloc, cfg.page_size, drafter_kv=cfg.num_draft_tokens > 0)
            reserve = ReserveRatio.scaled(cfg.conservativeness)
            self.ranks.append(RankState(r, alloc, reserve, cache=cache))
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._steps = itertools.count()
        self._outputs: list[RequestOutput] = []
        self.counters = StepCounters()

    @property
    def running(self) -> list[Request]:
        """Running requests of every rank."""
        return [req for rs in self.ranks for req in rs.running]

    @property
    def waiting(self) -> list[Request]:
        """Waiting requests of every rank."""
        return [req for rs in self.ranks for req in rs.waiting]

    @property
    def num_usable_pages(self) -> int:
        return sum(rs.alloc.num_usable for rs in self.ranks)

    @property
    def num_free_pages(self) -> int:
        return sum(rs.alloc.num_free for rs in self.ranks)

    # ------------------------------------------------------------ inputs

    def add_request(self, msg: GenerateRequest) -> None:
        req = Request(msg.rid, list(msg.prompt_ids), msg.sampling, next(self._arrivals))
        if msg.rid in self.requests:
            self._outputs.append(final_output(req, "error", "duplicate request id"))
            return
        n = len(req.prompt_ids)
        if n == 0:
            self._outputs.append(final_output(req, "error", "empty prompt"))
            return
        if n >= self.cfg.max_model_len:
            err = f"prompt has {n} tokens; the context length is {self.cfg.max_model_len}"
            self._outputs.append(final_output(req, "error", err))
            return
        waiting = sum(len(rs.waiting) for rs in self.ranks)
        if self.cfg.max_queue_len and waiting >= self.cfg.max_queue_len:
            err = f"the server is full ({waiting} requests waiting, --max-queue-len); retry later"
            self._outputs.append(
                final_output(req, "error", err, int(HTTPStatus.SERVICE_UNAVAILABLE))
            )
            return
        req.dp_rank = pick_rank(self.ranks, req)
        self.requests[req.rid] = req
        self.ranks[req.dp_rank].waiting.append(req)

    def abort(self, rid: str) -> None:
        req = self.requests.get(rid)
        if req is not None:
            self._finish(req, "abort")

    # ------------------------------------------------------------ steps

    def has_work(self) -> bool:
        """Requests to run, results to wait for, or finished requests a worker holds."""
        return any(rs.has_work() for rs in self.ranks)

    @property
    def num_inflight(self) -> int:
        """Plans out whose results are not all back (every plan has a batch per rank)."""
        return max(len(rs.inflight) for rs in self.ranks)

    def may_plan(self) -> bool:
        """Whether another plan may go out before the oldest result is back."""
        return self.num_inflight < self.cfg.max_inflight

    def build_plan(self) -> StepPlan | None:
        """Plan the next step of every rank and apply it to request state; None if
        nothing to send. A rank without rows gets an IDLE batch (its workers still
        run a dummy row: collectives need every rank)."""
        assert self.may_plan(), "too many plans in flight"
        decisions = []
        for rs in self.ranks:
            decision = schedule(
                rs.running, rs.waiting, rs.alloc, self.limits, rs.reserve.value, rs.cache
            )
            rs.reserve.update(decision)
            decisions.append(decision)
        to_drop = any(rs.finished_for_worker for rs in self.ranks)
        if not to_drop and not any(d.rows for d in decisions):
            return None
        step_id = next(self._steps)
        batches = []
        for rs, decision in zip(self.ranks, decisions):
            batches.append(rank_batch(decision, rs.finished_for_worker))
            rs.finished_for_worker = []
            rs.inflight.append((step_id, decision))
        self.counters.add(decisions)
        for decision in decisions:
            for s in decision.rows:  # the plan's effect, applied now (see request.py)
                s.req.num_computed += s.num_tokens
                s.req.num_pending += s.samples
                s.req.num_pending_drafts += s.num_draft
        if len(batches) == 1:  # NOTE: only DP ranks read the agreed graph
            return StepPlan(step_id, batches)
        rows, width = agreed_graph(batches, self.cfg.num_draft_tokens)
        tokens = 0 if rows else agreed_tokens(batches, self.cfg.piecewise_sizes)
        return StepPlan(step_id, batches, rows, width, tokens)

    def pump(
        self, submit: Callable[[StepPlan], None], receive: Callable[[], StepResult]
    ) -> list[RequestOutput]:
        """One turn of the step pipeline; returns outputs for the frontend.

        Sends a plan if one may go out and there is one; then, if no further plan
        may go out or there was nothing to plan, takes results until the oldest plan
        has every rank's; their outputs go out one rank's in turn (outputs.interleave).
        """
        outputs = self.take_outputs()
        plan = self.build_plan() if self.may_plan() else None
        if plan is not None:
            submit(plan)
        if self.num_inflight and (plan is None or not self.may_plan()):
            out = self.num_inflight
            # NOTE: by rank, not by result: two results of one rank keep their order
            per_rank: list[list[RequestOutput]] = [[] for _ in self.ranks]
            while self.num_inflight == out:
                result = receive()
                per_rank[result.dp_rank] += self.process_result(result)
            outputs += interleave(per_rank)
        return outputs

    def process_result(self, result: StepResult) -> list[RequestOutput]:
        """Apply one rank's result of its oldest plan; return outputs for the frontend."""
        rs = self.ranks[result.dp_rank]
        step_id, decision = rs.inflight.popleft()
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
            if s.samples:
                self._take_emitted(req, s, row)
            if rs.cache is not None and req.status is Status.RUNNING:
                rs.cache.insert(req)
        if self.cfg.check_invariants:
            self.check_integrity()
        return self.take_outputs()

    def _take_emitted(self, req: Request, s: Scheduled, row: RowResult) -> None:
        """A sampling row's emitted tokens join the output, cut at a finish; the
        accepted drafts' KV counts as computed (request.py)."""
        a = row.num_accepted
        assert 0 <= a <= s.num_draft, f"row {req.rid}: {a} accepted of {s.num_draft} drafts"
        assert len(row.token_ids) == a + 1, f"row {req.rid} emitted {row.token_ids}, {a} accepted"
        req.num_pending -= 1
        req.num_pending_drafts -= s.num_draft
        n, reason = cut_at_finish(
            req, row.token_ids, self.cfg.eos_token_ids, self.cfg.max_model_len
        )
        if s.num_draft:  # NOTE: accepted drafts count as far as they are emitted
            req.num_verify_steps += 1
            req.num_accepted += min(a, n - 1)
            self.counters.add_verified(min(a, n - 1))
        req.output_ids.extend(row.token_ids[:n])
        if row.logprobs is not None:
            req.pending_logprobs.extend(row.logprobs[:n])
        if n > 1:
            self.counters.add_kept(n)
        if reason is not None:
            self._finish(req, reason)
            return
        # NOTE: a preempted request (WAITING) recomputes from position 0 instead; a
        # floating row of it in flight starts after these accepted drafts (request.py)
        if a and req.status is Status.RUNNING:
            req.num_computed += a
        self._outputs.append(delta_output(req))

    def take_outputs(self) -> list[RequestOutput]:
        out, self._outputs = self._outputs, []
        return out

    # ------------------------------------------------------------ finishing

    def _finish(self, req: Request, reason: str, error: str | None = None) -> None:
        rs = self.ranks[req.dp_rank]
        if rs.cache is not None and req.status is Status.RUNNING:
            rs.cache.insert(req)  # NOTE: what it computed, for the next turn of a chat
        if req.status is Status.RUNNING:
            rs.running.remove(req)
        elif req.status is Status.WAITING:
            rs.waiting.remove(req)
        rs.alloc.free(req.pages)
        req.pages = []
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req.sent_to_worker:
            rs.finished_for_worker.append(req.rid)
        del self.requests[req.rid]
        out = delta_output(req)
        out.error = error
        self._outputs.append(out)

    def fail_all(self, message: str) -> list[RequestOutput]:
        for req in list(self.requests.values()):
            self._finish(req, "error", message)
        return self.take_outputs()

    # ------------------------------------------------------------ introspection

    def check_integrity(self) -> None:
        for rs in self.ranks:
            rs.alloc.check_integrity(
                r.pages for r in self.requests.values() if r.dp_rank == rs.dp_rank
            )
            for req in rs.running:
                assert req.status is Status.RUNNING and req.dp_rank == rs.dp_rank
                assert pages_needed(len(req.pages), req.num_computed, self.cfg.page_size) == 0
            for req in rs.waiting:
                assert req.status is Status.WAITING and req.dp_rank == rs.dp_rank
            if rs.cache is not None:
                rs.cache.check_integrity()

    def live_rids(self) -> set[str]:
        """Requests that will still send an output: those held, and those whose final
        output is not taken yet (finished, aborted or rejected since the last take)."""
        ending = {out.rid for out in self._outputs if out.finish_reason is not None}
        return self.requests.keys() | ending

    def stats(self, nonce: int) -> StatsReply:
        ok, err = True, None
        try:
            self.check_integrity()
        except AssertionError as e:
            ok, err = False, str(e) or "integrity check failed"
        return StatsReply(
            nonce=nonce,
            num_total_pages=self.num_usable_pages,
            num_free_pages=self.num_free_pages,
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            integrity_ok=ok,
            integrity_error=err,
            num_preemptions=self.counters.preemptions,
            spec_verify_steps=self.counters.verify_steps,
            spec_accepted=self.counters.accepted,
            prefix_cache_queries=sum(rs.cache.queried_tokens for rs in self.ranks if rs.cache),
            prefix_cache_hits=sum(rs.cache.hit_tokens for rs in self.ranks if rs.cache),
        )
