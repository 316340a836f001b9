"""Model runner: executes StepPlans and returns StepResults, in plan order.

The runner never decides what to run: rows, positions and pages come from the
scheduler. It keeps per-request state that the plan sends only as deltas
(page table, sampling state with outputs for penalties and seeded generator).

`submit(plan)` launches a step without waiting for the device; `take()` returns
the oldest step's result, blocking until its sampled ids are on the host. Between
the two, the next plan can be submitted: its PLACEHOLDER input ids (tokens the
scheduler has not seen yet) are filled on the device from `last_tokens`, where
every step scatters the ids it sampled, one slot per request.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.host_copy import upload
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import BatchTensors, RowInput, build_batch_tensors
from gyrfalcon.ipc.contract import PLACEHOLDER
from gyrfalcon.ipc.messages import (
    ForwardMode,
    NewRequest,
    RankBatch,
    RowResult,
    StepPlan,
    StepResult,
)
from gyrfalcon.kernels.device import set_launch_pdl
from gyrfalcon.layers.attention.registry import create_backend
from gyrfalcon.models.registry import build_model
from gyrfalcon.worker.cuda_graph import GraphRunner
from gyrfalcon.worker.kv_sizing import max_model_len, num_kv_pages
from gyrfalcon.worker.logprobs import HostCopy
from gyrfalcon.worker.sampler import (
    RequestSamplingState,
    argmax_rows,
    prepare,
    prompt_logprobs,
    sample,
    to_position_logprobs,
)
from gyrfalcon.worker.warmup import WARMUP_CHUNK, warmup_plans

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class WorkerRequest:
    prompt_ids: list[int]
    sampling: RequestSamplingState
    pages: list[int]
    slot: int  # row of ModelRunner.last_tokens


@dataclass
class PendingStep:
    """A launched step: its results are complete once `copy` has landed on the host."""

    step_id: int
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
                self.states[j].output_ids.append(token_ids[j])
                self.results[i].token_id = token_ids[j]
                k = self.states[j].params.logprobs
                if k is not None:
                    self.results[i].logprobs = to_position_logprobs(out, j, k)
        self.resolved = True
        return StepResult(step_id=self.step_id, rows=self.results)


class ModelRunner:
    def __init__(self, args: ServerArgs, model_cfg: ModelConfig, model_dir: str, rank: int = 0):
        """Load the model; call init_kv_cache() next. `args` must be resolved."""
        self.args, self.cfg = args, model_cfg
        self.device = torch.device(args.device if args.device != "cuda" else f"cuda:{rank}")
        self.dtype = DTYPES[args.dtype]
        self.page_size = args.page_size
        torch.manual_seed(args.seed)
        set_launch_pdl(not args.disable_pdl)
        t0 = time.perf_counter()
        self.model = build_model(model_cfg, model_dir, self.dtype, self.device, args.load_format)
        logger.info("model loaded in %.1f s", time.perf_counter() - t0)
        self.kv_cache: KVCache | None = None
        self.graphs: GraphRunner | None = None
        c = model_cfg
        shape = (c.num_heads, c.num_kv_heads, c.head_dim, c.head_dim**-0.5)
        self.attn = create_backend(args.attention_backend, *shape)  # prefill / mixed batches
        self.decode_attn = (
            self.attn
            if args.decode_attention_backend == args.attention_backend
            else create_backend(args.decode_attention_backend, *shape)
        )
        self.requests: dict[str, WorkerRequest] = {}
        self.pending: deque[PendingStep] = deque()
        self._free_slots: list[int] = []
        self.last_tokens = torch.zeros(0, dtype=torch.int64, device=self.device)

    def init_kv_cache(self, num_pages: int, max_model_len: int) -> None:
        """Allocate the paged KV cache (after weights, so sizing sees their memory),
        then set up decode graphs for contexts up to max_model_len."""
        c = self.cfg
        self.kv_cache = KVCache(
            c.num_layers,
            num_pages,
            self.page_size,
            c.num_kv_heads,
            c.head_dim,
            self.args.kv_dtype(self.dtype),
            self.device,
        )
        mode = self.args.graph_mode()
        if mode == "cuda" and not self.decode_attn.supports_cuda_graph:
            name = self.decode_attn.name
            logger.warning("%s backend cannot be captured; decode runs eagerly", name)
            mode = None
        if mode is None:
            return
        self.graphs = GraphRunner(
            self._decode_logits,
            self.decode_attn,
            self.kv_cache,
            self.page_size,
            max_bs=min(self.args.cuda_graph_max_bs, self.args.max_num_seqs),
            max_pages=-(-max_model_len // self.page_size),
            device=self.device,
            mode=mode,
            sizes=self.args.graph_batch_sizes(),
        )
        self.graphs.capture()

    def _decode_logits(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured function: a decode batch -> (logits [bs, vocab] in the model
        dtype, their argmax [bs]: the tokens of greedy rows without penalties, sampled
        in the graph)."""
        logits = self.model.compute_logits(self.model(batch))
        return logits, argmax_rows(logits)

    # ------------------------------------------------------------ request state

    def _add(self, new: NewRequest) -> None:
        assert new.rid not in self.requests, f"request {new.rid} sent twice"
        state = RequestSamplingState.create(
            new.sampling, list(new.prompt_ids), self.device, self.cfg.eos_token_ids
        )
        if not self._free_slots:  # grow last_tokens (stream-ordered, no sync)
            n = self.last_tokens.shape[0]
            grown = torch.zeros(max(64, 2 * n), dtype=torch.int64, device=self.device)
            grown[:n].copy_(self.last_tokens)
            self.last_tokens = grown
            self._free_slots = list(range(grown.shape[0] - 1, n - 1, -1))
        slot = self._free_slots.pop()
        self.requests[new.rid] = WorkerRequest(list(new.prompt_ids), state, [], slot)

    def _drop(self, rid: str) -> None:
        req = self.requests.pop(rid, None)
        if req is not None:
            self._free_slots.append(req.slot)

    # ------------------------------------------------------------ execution

    @torch.inference_mode()
    def submit(self, plan: StepPlan) -> None:
        """Launch `plan`; its result comes from a later `take()`."""
        for rid in plan.finished_rids:
            self._drop(rid)
        for new in plan.new_requests:
            self._add(new)
        # NOTE: one DP rank for now; plan.batches has exactly one entry.
        assert len(plan.batches) == 1, "multi-rank plans need the DP worker group"
        self.pending.append(self._launch(plan.step_id, plan.batches[0]))

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
        for plan in warmup_plans(self.page_size, chunk):
            self.execute(plan)
        assert not self.requests, "warm-up requests left behind"
        logger.info("warm-up steps ran in %.1f s", time.perf_counter() - t0)

    def _launch(self, step_id: int, rb: RankBatch) -> PendingStep:
        step = PendingStep(step_id, [RowResult(rid=row.rid, token_id=-1) for row in rb.rows])
        if not rb.rows:
            return step
        reqs: list[WorkerRequest] = []
        inputs: list[RowInput] = []
        ph_pos: list[int] = []  # token index of each PLACEHOLDER input
        ph_slot: list[int] = []  # and the slot holding its id
        n_tokens = 0
        for row in rb.rows:
            req = self.requests[row.rid]
            if row.reset:
                req.pages = []
            req.pages.extend(row.new_pages)
            reqs.append(req)
            inputs.append(RowInput(row.start, list(row.input_ids), req.pages))
            for j, tok in enumerate(row.input_ids):
                if tok == PLACEHOLDER:
                    ph_pos.append(n_tokens + j)
                    ph_slot.append(req.slot)
            n_tokens += len(row.input_ids)
        assert self.kv_cache is not None, "init_kv_cache() first"
        step.sample_rows = [i for i, row in enumerate(rb.rows) if row.sample]
        # NOTE: the placeholder fill and the sampled rows' slots ride in the step's one upload
        sample_slots = [reqs[i].slot for i in step.sample_rows]
        bt = build_batch_tensors(
            inputs, self.page_size, self.device, extra=[ph_pos, ph_slot, sample_slots]
        )
        ph_pos_t, ph_slot_t, slots = bt.extra
        if ph_pos:
            bt.input_ids[ph_pos_t] = self.last_tokens[ph_slot_t]
        if self.graphs is not None and self.graphs.can_run(rb.forward_mode, bt):
            assert len(step.sample_rows) == len(rb.rows), "every decode row samples"
            logits, argmax = self.graphs.run(bt)  # [bs, vocab], [bs]
        else:
            argmax = None
            logits = self._eager(rb, reqs, bt, step.results, step.sample_rows)
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
        out = sample(logits, batch, argmax)
        self.last_tokens.index_copy_(0, slots, out.token_ids)
        step.copy = HostCopy(out)
        return step

    def _eager(
        self,
        rb: RankBatch,
        reqs: list[WorkerRequest],
        bt: BatchTensors,
        results: list[RowResult],
        sample_rows: list[int],
    ) -> torch.Tensor:
        """Run the batch without graphs; returns logits of the sampling rows."""
        assert self.kv_cache is not None
        attn = self.decode_attn if rb.forward_mode == ForwardMode.DECODE else self.attn
        batch = ForwardBatch.from_tensors(rb.forward_mode, bt, self.page_size, self.kv_cache, attn)
        batch.attn_meta = attn.build_metadata(batch)
        hidden = self.model(batch)  # [T, hidden]
        self._prompt_logprobs(rb, reqs, hidden, bt.q_starts_cpu, results)
        rows = upload(sample_rows, torch.int64, self.device)
        return self.model.compute_logits(hidden[bt.last_token_idx[rows]])

    def _prompt_logprobs(
        self,
        rb: RankBatch,
        reqs: list[WorkerRequest],
        hidden: torch.Tensor,
        q_starts: list[int],
        results: list[RowResult],
    ) -> None:
        """Logprob of each prompt token given its prefix, for rows that asked."""
        for i, (row, req) in enumerate(zip(rb.rows, reqs)):
            k = req.sampling.params.prompt_logprobs
            if k is None:
                continue
            # positions p in [start, end) predict the prompt token at p + 1
            end = min(row.start + len(row.input_ids), len(req.prompt_ids) - 1)
            if end <= row.start:
                continue
            n = end - row.start
            logits = self.model.compute_logits(hidden[q_starts[i] : q_starts[i] + n])
            next_ids = upload(req.prompt_ids[row.start + 1 : end + 1], torch.int64, self.device)
            results[i].prompt_logprobs = prompt_logprobs(logits, next_ids, k)


def build_runner(
    args: ServerArgs, model_dir: str, cfg: ModelConfig, rank: int
) -> tuple[ModelRunner, int]:
    """Load the model, then size and allocate the KV cache; returns (runner, context len)."""
    if args.device == "cuda":
        torch.cuda.set_device(rank)
    runner = ModelRunner(args, cfg, model_dir, rank)
    pages = num_kv_pages(args, cfg, args.kv_dtype(runner.dtype), runner.device)
    context = max_model_len(args, cfg, pages)
    runner.init_kv_cache(pages, context)
    runner.warm_up(context)
    return runner, context
