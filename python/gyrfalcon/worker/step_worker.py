"""Step worker: executes StepPlans and returns StepResults, in plan order.

The worker never decides what to run: rows, positions and pages come from the
scheduler. It drives a `RequestTable` (per-request state the plan sends only as
deltas) and a `ModelExecutor` (the model, its KV cache, backends and graphs),
and samples.

`submit(plan)` launches this worker's DP rank's batch of a step without waiting
for the device; `take()` returns the oldest step's result, blocking until its
sampled ids are on the host. Between the two, the next plan can be submitted: its
PLACEHOLDER input ids (tokens the scheduler has not seen yet) are filled on the
device from the table's `last_tokens`, where every step scatters the last token
each sampling row emitted, one slot per request.

A row's result is the list of tokens it emitted (one per sampling row today;
draft tokens the worker accepts will join it) and the accepted draft count. An
IDLE batch (no rows) still runs one padded dummy row on the dummy page through
the normal decode path, since collectives will need every rank in every step,
and returns no rows.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.forward.host_copy import upload
from gyrfalcon.forward.metadata import BatchTensors, RowInput, build_batch_tensors
from gyrfalcon.ipc.contract import DUMMY_PAGE, PLACEHOLDER
from gyrfalcon.ipc.messages import (
    ForwardMode,
    RankBatch,
    RowResult,
    ScheduledRow,
    StepPlan,
    StepResult,
)
from gyrfalcon.worker.executor import ModelExecutor
from gyrfalcon.worker.kv_sizing import max_model_len, num_kv_pages
from gyrfalcon.worker.logprobs import HostCopy
from gyrfalcon.worker.request_table import RequestTable, WorkerRequest
from gyrfalcon.worker.sampler import (
    RequestSamplingState,
    prepare,
    prompt_logprobs,
    sample,
    to_position_logprobs,
)
from gyrfalcon.worker.warmup import WARMUP_CHUNK, warmup_batches

logger = logging.getLogger(__name__)


@dataclass
class PendingStep:
    """A launched step: its results are complete once `copy` has landed on the host."""

    step_id: int
    dp_rank: int
    results: list[RowResult]
    sample_rows: list[int] = field(default_factory=list)  # indices into results
    states: list[RequestSamplingState] = field(default_factory=list)  # of the sample rows
    copy: HostCopy | None = None
    resolved: bool = False

    def done(self) -> bool:
        return self.copy is None or self.copy.done()

    def resolve(self) -> StepResult:
        """Wait for the sampled ids; record them in the requests' sampling state (once)."""
        if not self.resolved and self.copy is not None:
            out = self.copy.wait()
            token_ids = out.token_ids.tolist()
            for j, i in enumerate(self.sample_rows):
                emitted = [token_ids[j]]  # NOTE: no drafts yet: one token, none accepted
                self.states[j].output_ids.extend(emitted)
                self.results[i].token_ids = emitted
                k = self.states[j].params.logprobs
                if k is not None:
                    self.results[i].logprobs = [to_position_logprobs(out, j, k)]
        self.resolved = True
        return StepResult(self.step_id, self.results, self.dp_rank)


class StepWorker:
    def __init__(
        self,
        args: ServerArgs,
        model_cfg: ModelConfig,
        model_dir: str,
        rank: int = 0,
        dp_rank: int = 0,
    ):
        """Load the model; call init_kv_cache() next. `args` must be resolved. The worker
        runs batch `dp_rank` of every plan (its DP group's)."""
        self.args, self.cfg, self.dp_rank = args, model_cfg, dp_rank
        self.device = torch.device(args.device if args.device != "cuda" else f"cuda:{rank}")
        torch.manual_seed(args.seed)
        self.executor = ModelExecutor(args, model_cfg, model_dir, self.device)
        self.requests = RequestTable(self.device, model_cfg.eos_token_ids)
        self.pending: deque[PendingStep] = deque()

    def init_kv_cache(self, num_pages: int, max_model_len: int) -> None:
        self.executor.init_kv_cache(num_pages, max_model_len)

    # ------------------------------------------------------------ execution

    @torch.inference_mode()
    def submit(self, plan: StepPlan) -> None:
        """Launch this rank's batch of `plan`; its result comes from a later `take()`."""
        self.submit_batch(plan.step_id, plan.batches[self.dp_rank])

    @torch.inference_mode()
    def submit_batch(self, step_id: int, rb: RankBatch) -> None:
        """Launch one rank batch (step `step_id`); its result comes from `take()`."""
        for rid in rb.finished_rids:
            self.requests.drop(rid)
        for new in rb.new_requests:
            self.requests.add(new)
        if rb.forward_mode == ForwardMode.IDLE:
            assert not rb.rows, "an IDLE batch has no rows"
            self._run_dummy_row()
            self.pending.append(PendingStep(step_id, self.dp_rank, []))
        else:
            assert rb.rows, f"a {rb.forward_mode.name} batch without rows"
            self.pending.append(self._launch(step_id, rb))

    def oldest_done(self) -> bool:
        """Whether take() would return without waiting for the device."""
        return bool(self.pending) and self.pending[0].done()

    def take(self) -> StepResult:
        """The oldest submitted step's result (blocks until its ids are on the host)."""
        return self.pending.popleft().resolve()

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan to completion (nothing else may be in flight)."""
        assert not self.pending, "execute() with steps in flight"
        self.submit(plan)
        return self.take()

    def warm_up(self, context_len: int) -> None:
        """Run one step of each kind on the dummy page (kernels compile now, not in the
        first requests), within `context_len` positions; leaves no request state behind."""
        chunk = min(WARMUP_CHUNK, (context_len - 2) // 2)  # the longest row: 2 chunks + 2
        if chunk < 1:
            return
        t0 = time.perf_counter()
        assert not self.pending, "warm-up with steps in flight"
        for i, rb in enumerate(warmup_batches(self.args.page_size, chunk)):
            self.submit_batch(-1 - i, rb)  # NOTE: negative step ids: never the scheduler's
            self.take()
        assert not len(self.requests), "warm-up requests left behind"
        logger.info("warm-up steps ran in %.1f s", time.perf_counter() - t0)

    def _run_dummy_row(self) -> None:
        """An IDLE rank's step: one padded row (token 0 at position 0 on the dummy page)
        through the executor's normal DECODE path, graphs included; output discarded."""
        dummy = RowInput(0, [0], [DUMMY_PAGE])
        bt = build_batch_tensors([dummy], self.args.page_size, self.device, extra=[[0]])
        self.executor.forward(ForwardMode.DECODE, bt, bt.extra[0], True)

    def _launch(self, step_id: int, rb: RankBatch) -> PendingStep:
        step = PendingStep(step_id, self.dp_rank, [RowResult(row.rid) for row in rb.rows])
        reqs: list[WorkerRequest] = []
        inputs: list[RowInput] = []
        ph_pos: list[int] = []  # token index of each PLACEHOLDER input
        ph_slot: list[int] = []  # and the slot holding its id
        n_tokens = 0
        for row in rb.rows:
            assert not row.num_draft, "draft slots need a drafter; this worker has none"
            req = self.requests.apply(row)
            reqs.append(req)
            inputs.append(RowInput(row.start, list(row.input_ids), req.pages))
            for j, tok in enumerate(row.input_ids):
                if tok == PLACEHOLDER:
                    ph_pos.append(n_tokens + j)
                    ph_slot.append(req.slot)
            n_tokens += len(row.input_ids)
        step.sample_rows = [i for i, row in enumerate(rb.rows) if row.sample]
        # NOTE: the placeholder fill, the sampled rows' slots and their batch rows ride
        # in the step's one upload
        sample_slots = [reqs[i].slot for i in step.sample_rows]
        bt = build_batch_tensors(
            inputs,
            self.args.page_size,
            self.device,
            extra=[ph_pos, ph_slot, sample_slots, step.sample_rows],
        )
        ph_pos_t, ph_slot_t, slots, sample_rows_t = bt.extra
        if ph_pos:
            bt.input_ids[ph_pos_t] = self.requests.last_tokens[ph_slot_t]
        every_row = len(step.sample_rows) == len(rb.rows)
        out = self.executor.forward(rb.forward_mode, bt, sample_rows_t, every_row)
        if out.hidden is not None:
            self._prompt_logprobs(rb.rows, reqs, out.hidden, bt, step.results)
        if not step.sample_rows:
            return step
        step.states = [reqs[i].sampling for i in step.sample_rows]
        if any(s.has_penalty for s in step.states):
            # NOTE: penalties read output_ids on the host: earlier steps must be in.
            for earlier in self.pending:
                earlier.resolve()
        # tokens generated before each sample: its row's end position minus the prompt
        num_generated = [
            rb.rows[i].start + len(rb.rows[i].input_ids) - len(reqs[i].prompt_ids)
            for i in step.sample_rows
        ]
        batch = prepare(step.states, self.cfg.vocab_size, self.device, num_generated)
        sampled = sample(out.logits, batch, out.argmax, self.executor.ctx.kernels)
        self.requests.record_last(slots, sampled.token_ids)
        step.copy = HostCopy(sampled)
        return step

    def _prompt_logprobs(
        self,
        rows: list[ScheduledRow],
        reqs: list[WorkerRequest],
        hidden: torch.Tensor,
        bt: BatchTensors,
        results: list[RowResult],
    ) -> None:
        """Logprob of each prompt token given its prefix, for rows that asked."""
        for i, (row, req) in enumerate(zip(rows, reqs)):
            k = req.sampling.params.prompt_logprobs
            if k is None:
                continue
            # positions p in [start, end) predict the prompt token at p + 1
            end = min(row.start + len(row.input_ids), len(req.prompt_ids) - 1)
            if end <= row.start:
                continue
            n = end - row.start
            first = bt.q_starts_cpu[i]
            logits = self.executor.compute_logits(hidden[first : first + n])
            next_ids = upload(req.prompt_ids[row.start + 1 : end + 1], torch.int64, self.device)
            results[i].prompt_logprobs = prompt_logprobs(logits, next_ids, k)


def build_worker(
    args: ServerArgs, model_dir: str, cfg: ModelConfig, rank: int, dp_rank: int = 0
) -> tuple[StepWorker, int]:
    """Load the model, then size and allocate the KV cache; returns (worker, context len)."""
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    worker = StepWorker(args, cfg, model_dir, rank, dp_rank)
    executor = worker.executor
    tp_size = executor.ctx.parallel.tp_size
    pages = num_kv_pages(args, cfg, args.kv_dtype(executor.dtype), worker.device, tp_size)
    context = max_model_len(args, cfg, pages)
    worker.init_kv_cache(pages, context)
    worker.warm_up(context)
    return worker, context
