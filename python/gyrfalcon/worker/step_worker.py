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

import torch

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.forward.metadata import (
    RowInput,
    build_batch_tensors,
    shift_rows,
)
from gyrfalcon.forward.parallel import SINGLE_RANK, ParallelContext
from gyrfalcon.ipc.contract import DUMMY_PAGE, step_tokens, verifies_drafts
from gyrfalcon.ipc.messages import (
    ForwardMode,
    RankBatch,
    RowResult,
    StepPlan,
    StepResult,
)
from gyrfalcon.worker.compile_watch import CompileWatch
from gyrfalcon.worker.drafter import Drafter
from gyrfalcon.worker.executor import ModelExecutor
from gyrfalcon.worker.grammar_state import WorkerGrammars, warm_up_masks
from gyrfalcon.worker.logprobs import HostCopy, SampleOutput, fill_prompt_logprobs
from gyrfalcon.worker.memory_profile import check_largest_step_fits, fit_kv_cache
from gyrfalcon.worker.pending_step import PendingStep
from gyrfalcon.worker.request_table import MIN_SLOTS, RequestTable
from gyrfalcon.worker.sampler import prepare, sample
from gyrfalcon.worker.spec_step_graph import FusedSpecStep
from gyrfalcon.worker.spec_verify import (
    VerifyIndex,
    emitted_index,
    padded_index,
    verify_sample,
)
from gyrfalcon.worker.step_layout import StepLayout, batch_input_ids, latest_start
from gyrfalcon.worker.step_stats import StepStats
from gyrfalcon.worker.warmup import warmup_batches, warmup_chunk

logger = logging.getLogger(__name__)

# Request-table slots reserved per running request where graphs capture the table:
# finished requests hold theirs until the next plan drops them, preempted ones longer
RESERVED_SLOTS_PER_SEQ = 4


def rank_device(args: ServerArgs, rank: int) -> torch.device:
    """The device of worker `rank`: its own GPU of its node on CUDA."""
    local = rank - args.node_ranks().start  # NOTE: rank itself on one node
    return torch.device(args.device if args.device != "cuda" else f"cuda:{local}")


class StepWorker:
    def __init__(
        self,
        args: ServerArgs,
        model_cfg: ModelConfig,
        model_dir: str,
        rank: int = 0,
        dp_rank: int = 0,
        parallel: ParallelContext = SINGLE_RANK,
    ):
        """Load this rank's share of the model (`parallel`: its TP group); call
        init_kv_cache() next. `args` must be resolved. The worker runs batch `dp_rank` of
        every plan (its DP group's)."""
        self.args, self.cfg, self.dp_rank = args, model_cfg, dp_rank
        self.device = rank_device(args, rank)
        # NOTE: the same seed on every rank: TP ranks draw the same samples in lockstep
        torch.manual_seed(args.seed)
        self.executor = ex = ModelExecutor(args, model_cfg, model_dir, self.device, parallel)
        self.drafter: Drafter | None = None
        if args.speculative_algorithm:
            embed = ex.model.embed_tokens
            self.drafter = Drafter(args, model_cfg, embed, ex.dtype, self.device, ex.ctx)
            ex.aux_layers = self.drafter.aux_layers  # NOTE: before any graph is captured
        self.num_draft = self.drafter.k if self.drafter else 0
        eos = model_cfg.eos_token_ids
        grammars = WorkerGrammars(args.tokenizer or model_dir, model_cfg.vocab_size, eos)
        self.requests = RequestTable(self.device, eos, self.num_draft, grammars)
        self.pending: deque[PendingStep] = deque()
        self.max_model_len = 0
        self.step_peak = 0  # the largest step's activation bytes where measured (CUDA)
        self.fused: FusedSpecStep | None = None  # the whole greedy spec step in one graph
        # where the DP ranks' collectives span the DP groups, the plan's agreed graph
        # size (`StepPlan.graph_rows`; 0: eager, as in warm-up) and tokens per row
        # (`graph_width`); None: this rank decides
        self.graph_rows: int | None = 0 if args.dp_ranks_agree() else None
        self.graph_width = 1
        self.graph_tokens = 0  # where graph_rows is 0, the plan's `graph_tokens`
        self.num_plans = 0  # plans run (warm-up excluded)
        self.stats = StepStats(self.device)  # per kind of step (warm-up excluded)
        self.compiles = CompileWatch()  # Triton kernels first built after the warm-up

    @property
    def floats_rows(self) -> bool:
        """Whether this worker runs floating rows (ScheduledRow): with a drafter whose
        round, like the target's verify, attends over lengths on the device."""
        if self.drafter is None:
            return False
        return self.executor.backends.verify.device_lengths and (
            self.drafter.backends.extend.device_lengths
        )

    def init_kv_cache(self, num_pages: int, max_model_len: int) -> None:
        """The drafter's own pages, then the target's KV cache and graphs: VERIFY ones for
        k + 1 tokens per row with a drafter, and the fused greedy step (spec_step_graph.py)
        where rows float; then the drafter's round graphs."""
        self.max_model_len = max_model_len
        verify, extra = None, []
        if self.drafter is not None:
            verify = self.num_draft + 1
            self.drafter.init_kv_cache(num_pages, self.args.kv_dtype(self.executor.dtype))
            # NOTE: DP ranks that agree on graphs replay it at the plan's size (`takes`)
            if self.floats_rows and self.args.graph_mode() is not None:
                if self.requests.scratch is None:  # NOTE: kept when the cache is resized
                    self.requests.reserve(
                        max(MIN_SLOTS, RESERVED_SLOTS_PER_SEQ * self.args.max_num_seqs)
                    )
                max_bs = self.executor.graph_max_bs
                self.fused = FusedSpecStep(self.executor, self.drafter, self.requests, max_bs)
                extra.append(self.fused.spec())
        self.executor.init_kv_cache(num_pages, max_model_len, verify, extra)
        if self.drafter is not None:
            self.drafter.setup_graphs(max_model_len)

    def release_kv_cache(self) -> None:
        """Drop the KV caches and every graph over them (before `init_kv_cache` with
        another page count; nothing may be in flight and no request held)."""
        assert not self.pending and not len(self.requests), "release with requests held"
        ex = self.executor
        ex.graphs = ex.piecewise = ex.kv_cache = None
        if self.drafter is not None:
            dr = self.drafter
            dr.graphs = dr.static = dr.kv_cache = dr.piecewise = dr.ext_aux = None
        self.fused = None

    # ------------------------------------------------------------ execution

    @torch.inference_mode()
    def submit(self, plan: StepPlan) -> None:
        """Launch this rank's batch of `plan`; its result comes from a later `take()`."""
        self.num_plans += 1
        if self.graph_rows is not None:
            self.graph_rows, self.graph_width = plan.graph_rows, plan.graph_width
            self.graph_tokens = plan.graph_tokens
        began = self.stats.begin()
        try:
            self.submit_batch(plan.step_id, plan.batches[self.dp_rank])
        finally:
            if self.graph_rows is not None:
                # NOTE: batches outside a plan (warm-up) run eagerly
                self.graph_rows, self.graph_tokens = 0, 0
        step = self.pending[-1]
        step.span = self.stats.end(step.kind, len(step.results), began)

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
            self.pending.append(PendingStep(step_id, self.dp_rank, [], kind="idle"))
        else:
            assert rb.rows, f"a {rb.forward_mode.name} batch without rows"
            self.pending.append(self._launch(step_id, rb))

    def summary(self) -> str:
        """How many plans ran, how many target forwards replayed graphs, and the time
        per kind of step (step_stats.py)."""
        graphs = self.executor.graphs
        runs = graphs.num_runs if graphs is not None else 0
        counts = f"{self.num_plans} steps, {runs} target forwards through graphs"
        return f"{counts}; {self.stats.summary()}; {self.compiles.summary()}"

    def oldest_done(self) -> bool:
        """Whether take() would return without waiting for the device."""
        return bool(self.pending) and self.pending[0].done()

    def take(self) -> StepResult:
        """The oldest submitted step's result (blocks until its ids are on the host)."""
        step = self.pending.popleft()
        result = step.resolve()
        self.stats.span_done(step.span)
        return result

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan to completion (nothing else may be in flight)."""
        assert not self.pending, "execute() with steps in flight"
        self.submit(plan)
        return self.take()

    def warm_up(self, context_len: int) -> None:
        """Run one step of each kind on the dummy page (kernels compile now, not in the
        first requests), within `context_len` positions; leaves no request state behind."""
        k = self.num_draft
        chunk = warmup_chunk(context_len, k)
        if chunk >= 1:
            t0 = time.perf_counter()
            assert not self.pending, "warm-up with steps in flight"
            for i, rb in enumerate(warmup_batches(self.args.page_size, chunk, k)):
                self.submit_batch(-1 - i, rb)  # NOTE: negative step ids: never the scheduler's
                self.take()
            assert not len(self.requests), "warm-up requests left behind"
            logger.info("warm-up steps ran in %.1f s", time.perf_counter() - t0)
        if self.device.type == "cuda":
            self.executor.warm_up_kernels(self.args.max_num_seqs)
            if self.drafter is not None:
                self.drafter.warm_up_kernels(self.args.max_num_seqs)
            warm_up_masks(self.cfg.vocab_size, self.device)
            fit_kv_cache(self)
            check_largest_step_fits(self, self.max_model_len)
            self.compiles.install()

    def _run_dummy_row(self) -> None:
        """An IDLE rank's step: one padded row (token 0 at positions 0 .. t - 1 on the
        dummy page) through the executor's normal path, graphs included (piecewise ones
        at the plan's `graph_tokens`); output discarded. t is the plan's `graph_width`:
        a DECODE row, or a VERIFY row of k + 1 tokens when the other ranks verify in the
        agreed graph."""
        t = self.graph_width
        mode = ForwardMode.DECODE if t == 1 else ForwardMode.VERIFY
        ps = self.args.page_size
        dummy = RowInput(0, [0] * t, [DUMMY_PAGE] * -(-t // ps))
        bt = build_batch_tensors([dummy], ps, self.device, extra=[list(range(t))])
        self.executor.forward(mode, bt, bt.extra[0], True, self.graph_rows, self.graph_tokens)

    def _launch(self, step_id: int, rb: RankBatch) -> PendingStep:
        rows = rb.rows
        step = PendingStep(step_id, self.dp_rank, [RowResult(row.rid) for row in rows])
        reqs = self.requests.apply(rows)
        k, width = self.num_draft, 1 + max(row.num_draft for row in rows)
        assert width - 1 <= k, f"rows verify {width - 1} drafts, the drafter makes {k}"
        fused = self.fused
        if fused is not None and fused.takes(rows, reqs, self.graph_rows, self.executor.graphs):
            return fused.launch_step(step, rows, reqs, self.max_model_len, self.graph_rows or 0)
        step.sample_rows = [i for i, row in enumerate(rows) if row.sample]
        # the sampling rows and their requests (NOTE: every row's, as is, where all sample)
        every = len(step.sample_rows) == len(rows)
        s_rows = rows if every else [rows[i] for i in step.sample_rows]
        s_reqs = reqs if every else [reqs[i] for i in step.sample_rows]
        num_tokens = step_tokens(rows)  # NOTE: as the plan counts them (`agreed_tokens`)
        layout = StepLayout(num_tokens, len(step.sample_rows) * width, width)
        if self.drafter is None:  # NOTE: then no row verifies drafts (k = 0) nor floats
            inputs = [RowInput(row.start, row.input_ids, req.pages) for row, req in zip(rows, reqs)]
            layout.add_plain(rows, reqs)
        else:
            inputs = [
                RowInput(latest_start(row), batch_input_ids(row), req.pages)
                for row, req in zip(rows, reqs)
            ]
            for row, req in zip(rows, reqs):
                drafting = verifies_drafts(req.sampling.params)
                layout.add(row, req, k, drafting, self.max_model_len, self.args.page_size)
        step.width, step.logit_starts = width, layout.logit_starts
        sample_slots = [req.slot for req in s_reqs]
        num_drafts: list[int] = []
        verify_lists = []
        if width > 1:
            num_drafts = [row.num_draft for row in s_rows]
            verify_lists = [padded_index(num_drafts, width), emitted_index(num_drafts, width)]
            verify_lists.append(num_drafts)
        # NOTE: every row drafts (the steady state): the drafter's extend batch is this
        # one with its own ids, so its round's index lists ride along too
        shared = len(layout.ext_rows) == len(rows)
        draft_lists = layout.draft_lists() if shared else []
        # NOTE: the fills, the sampling rows' slots and logit rows, the next prompt
        # tokens of drafted chunks and the verify layout ride in the step's one upload
        main_lists = [*layout.lists(), sample_slots]
        bt = build_batch_tensors(
            inputs,
            self.args.page_size,
            self.device,
            extra=[*main_lists, *verify_lists, *draft_lists],
        )
        ph_pos_t, ph_slot_t, dr_pos_t, dr_src_t, logit_t, next_t, *more = bt.extra
        sample_t, fl_rows_t, fl_slots_t, fl_tokens_t, fl_token_rows_t, slots = more[:6]
        verify_t = bt.extra[len(main_lists) : len(main_lists) + len(verify_lists)]
        draft_t = bt.extra[len(main_lists) + len(verify_lists) :] if shared else None
        shift = None
        if layout.fl_rows:  # NOTE: floating rows start where their previous row ended
            shift = self.requests.next_pos[fl_slots_t] - bt.positions[bt.q_starts[fl_rows_t]]
            shift_rows(bt, fl_rows_t, shift, fl_tokens_t, fl_token_rows_t, self.args.page_size)
        if len(layout.ph_pos) == num_tokens:  # NOTE: the batch's tokens, draft slots included
            # NOTE: every input is a placeholder (decode rows behind the step in flight):
            # ph_pos ascends, so it is every token in order, and one gather writes them
            # all (an index and an index_put cost a GPU host twice the torch calls)
            torch.index_select(self.requests.last_tokens, 0, ph_slot_t, out=bt.input_ids)
        elif layout.ph_pos:
            bt.input_ids[ph_pos_t] = self.requests.last_tokens[ph_slot_t]
        if layout.dr_pos:
            bt.input_ids[dr_pos_t] = self.requests.draft_tokens.view(-1)[dr_src_t]
        every_token = len(layout.logit_tokens) == num_tokens
        out = self.executor.forward(
            rb.forward_mode, bt, logit_t, every_token, self.graph_rows, self.graph_tokens
        )
        step.kind = out.ran
        if out.hidden is not None:
            fill_prompt_logprobs(
                rows, reqs, out.hidden, bt.q_starts_cpu, step.results,
                self.executor.compute_logits, self.cfg.vocab_size, self.device,
            )  # fmt: skip
        emitted = accept_len = None
        if step.sample_rows:
            step.states = [req.sampling for req in s_reqs]
            if any(s.reads_outputs for s in step.states):
                # NOTE: penalties and grammars read output_ids on the host: earlier steps
                # must be in (the forward above is already queued behind them).
                for earlier in self.pending:
                    earlier.resolve()
            # tokens generated before each sample: its row's end position minus the prompt
            num_generated = [
                row.start + len(row.input_ids) - len(req.prompt_ids)
                for row, req in zip(s_rows, s_reqs)
            ]
            vocab, kernels = self.cfg.vocab_size, self.executor.ctx.kernels
            if width == 1:
                batch = prepare(step.states, vocab, self.device, num_generated)
                sampled = sample(out.logits, batch, out.argmax, kernels)
                step.copy = HostCopy(sampled)
                last = emitted = sampled.token_ids
            else:
                idx = VerifyIndex(num_drafts, width, *verify_t)
                drafts = self.requests.draft_tokens[slots]
                acc, per_row = verify_sample(
                    out.logits, out.argmax, step.states, num_generated, drafts, idx, vocab, kernels
                )
                ids = torch.cat([acc.accept_len, acc.token_ids.view(-1), per_row.token_ids])
                lp = (per_row.logprobs, per_row.top_ids, per_row.top_logprobs)
                step.copy = HostCopy(SampleOutput(ids, *lp))
                last, emitted, accept_len = acc.last_token_ids, acc.token_ids, acc.accept_len
            self.requests.record_last(slots, last)
            if self.drafter is not None:  # where each request goes on (floating rows)
                next_pos = bt.positions[sample_t] + 1
                if accept_len is not None:
                    next_pos = next_pos + accept_len
                self.requests.record_next_pos(slots, next_pos)
        if layout.ext_rows:
            fl = None if shift is None else (shift, fl_token_rows_t)
            assert self.drafter is not None and out.aux is not None
            self.drafter.draft_step(
                layout, bt, emitted, accept_len, next_t, out.aux, fl, draft_t,
                self.requests.draft_tokens,
            )  # fmt: skip
        return step
