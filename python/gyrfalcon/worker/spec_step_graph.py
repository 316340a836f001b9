"""The whole greedy spec step as ONE captured graph (variant "step" of VERIFY).

A steady-state step of greedy requests (every row a verify row of k drafts after one
input; no logprobs, penalties or logit adjustments) needs, besides the two graphs of
the general path (the target's VERIFY, the draft round), some sixty small launches on
the host: the step's fills and moves, greedy acceptance, the request table's
records, the round's inputs. On a small model their host time is most of the step
(benchmarks/NOTES.md). Here they are captured with the target's forward and the
round, in the executor's graph runner (its memory pool):

  1. floating rows move to their device start: start = next_pos[slot] where the row
     floats, else its host start; positions, KV slots (through the page table) and
     lengths move with it, in the static buffers, before any kernel reads them;
  2. inputs: the last emitted token where the row's input is a placeholder, then the
     k drafts from draft_tokens[slot];
  3. the target's VERIFY forward: logits, argmax, aux states;
  4. greedy acceptance (`spec_accept.greedy_verify`);
  5. records: last_tokens[slot] = the last emitted token, next_pos[slot] = start + 1 +
     accepted;
  6. the draft round (`Drafter.verify_round`) over the same rows with the emitted
     tokens as ids; draft_tokens[slot] = its drafts.

The rows' other inputs ride in one static [4, max_bs] block (`ROW_FIELDS`): slot,
floats, placeholder, last position; padded rows name the request table's scratch
slot (their records land there) with the rest 0 (position 0 on the dummy page).

The request table's tensors are captured by address: if the table ever grows past
the capacity reserved for it (`RequestTable.reserve`), the graphs are stale and
steps run the general path from then on.
"""

from __future__ import annotations

import logging

import torch

from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.metadata import BatchTensors, RowInput, build_batch_tensors
from gyrfalcon.ipc.contract import PLACEHOLDER, is_steady_verify_row
from gyrfalcon.ipc.messages import ForwardMode, ScheduledRow
from gyrfalcon.worker.cuda_graph import GraphRunner, GraphSpec, padded_batch_size
from gyrfalcon.worker.drafter import Drafter
from gyrfalcon.worker.executor import ModelExecutor
from gyrfalcon.worker.logprobs import HostCopy, SampleOutput
from gyrfalcon.worker.pending_step import PendingStep
from gyrfalcon.worker.request_table import RequestTable, WorkerRequest
from gyrfalcon.worker.sampler import is_greedy
from gyrfalcon.worker.sampling_state import RequestSamplingState
from gyrfalcon.worker.spec_accept import greedy_verify
from gyrfalcon.worker.step_layout import latest_start

logger = logging.getLogger(__name__)

VARIANT = "step"
ROW_FIELDS = ("slot", "floats", "placeholder", "last_pos")


def fuses(state: RequestSamplingState) -> bool:
    """Whether a request's verify rows may run in the fused step: greedy, reading
    nothing but the argmax (no logprobs, penalties, bias, allowed ids, min_tokens)."""
    p = state.params
    return (
        is_greedy(p) and not state.adjusts_logits and not state.has_penalty and (p.logprobs is None)
    )


class FusedSpecStep:
    def __init__(self, executor: ModelExecutor, drafter: Drafter, table: RequestTable, max_bs: int):
        """The step's callable over `executor`'s VERIFY batches, `drafter`'s round and
        `table` (reserved already: its scratch slot takes the padded rows' records)."""
        assert table.scratch is not None, "reserve the request table first"
        self.executor, self.drafter, self.table = executor, drafter, table
        self.k, self.page_size = drafter.k, executor.page_size
        device = table.last_tokens.device
        self.rows = torch.zeros(len(ROW_FIELDS), max_bs, dtype=torch.int64, device=device)
        self.pad = torch.zeros(len(ROW_FIELDS), 1, dtype=torch.int64, device=device)
        self.pad[0] = table.scratch
        self.rows.copy_(self.pad.expand_as(self.rows))
        self.generation = table.generation
        self.warned = False

    def spec(self) -> GraphSpec:
        backend = self.executor.backends.verify
        inner = ((self.drafter.backends.extend, ForwardMode.DRAFT_EXTEND),)
        return GraphSpec(ForwardMode.VERIFY, self.k + 1, self._step, backend, VARIANT, inner)

    def usable(self, graphs: GraphRunner | None, bs: int, max_pages: int) -> bool:
        """Whether a batch of bs rows with up to max_pages pages each runs fused."""
        if graphs is None or (ForwardMode.VERIFY, VARIANT) not in graphs.specs:
            return False
        if self.table.generation != self.generation:
            if not self.warned:
                logger.warning("the request table outgrew its reserve: spec steps run unfused")
                self.warned = True
            return False
        return bs <= graphs.sizes[-1] and max_pages <= graphs.buf.max_pages

    def takes(
        self,
        rows: list[ScheduledRow],
        reqs: list[WorkerRequest],
        agreed: int | None,
        graphs: GraphRunner | None,
    ) -> bool:
        """Whether a step of these rows runs fused: every row a verify row of k drafts
        after one input, of a request that `fuses`, in a captured size. agreed: the rows
        the DP ranks agreed on (`StepPlan.graph_rows`; 0: eager, None: no agreement)."""
        return (
            agreed != 0  # NOTE: the DP ranks agreed on eager: the general path
            and all(is_steady_verify_row(r, self.k) for r in rows)
            and all(fuses(q.sampling) for q in reqs)
            and self.usable(graphs, max(len(rows), agreed or 0), max(len(q.pages) for q in reqs))
        )

    def launch_step(
        self,
        step: PendingStep,
        rows: list[ScheduledRow],
        reqs: list[WorkerRequest],
        max_model_len: int,
        agreed: int = 0,
    ) -> PendingStep:
        """`step` (its results one per row) as one replay of `launch`; its ids come back
        as a verify step's (accepted, emitted)."""
        accepted, emitted = self.launch(rows, reqs, max_model_len, agreed)
        step.sample_rows = list(range(len(rows)))
        step.states = [q.sampling for q in reqs]
        step.width, step.kind = self.k + 1, "fused"
        ids = torch.cat([accepted, emitted.view(-1)])
        step.copy = HostCopy(SampleOutput(ids, None, None, None))
        return step

    def launch(
        self,
        rows: list[ScheduledRow],
        reqs: list[WorkerRequest],
        max_model_len: int,
        agreed: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The step for these verify rows as one replay: the batch at the rows' latest
        starts and their `ROW_FIELDS` in one upload -> `run`'s (accepted, emitted);
        agreed: the rows the DP ranks agreed to pad to (`StepPlan.graph_rows`), or 0."""
        graphs = self.executor.graphs
        assert graphs is not None, "the fused step runs through the executor's graphs"
        ps, k = self.page_size, self.k
        inputs = [
            RowInput(latest_start(r), [r.input_ids[0]] + [0] * k, q.pages)
            for r, q in zip(rows, reqs)
        ]
        fields = [q.slot for q in reqs]
        fields += [int(r.drafts_in_flight > 0) for r in rows]
        fields += [int(r.input_ids[0] == PLACEHOLDER) for r in rows]
        fields += [min(len(q.pages) * ps, max_model_len) - 1 for q in reqs]
        bt = build_batch_tensors(inputs, ps, self.rows.device, extra=[fields])
        return self.run(graphs, bt, bt.extra[0].view(len(ROW_FIELDS), len(rows)), agreed)

    def run(
        self, graphs: GraphRunner, bt: BatchTensors, rows: torch.Tensor, agreed: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the step for bt's rows (rows: their [4, bs] `ROW_FIELDS`), padded to
        at least `agreed` rows -> (accepted [bs], emitted [bs, k + 1] padded with
        EMIT_PAD)."""
        bs, k1 = rows.shape[1], self.k + 1
        padded = padded_batch_size(max(bs, agreed), graphs.sizes)
        self.rows[:, :bs].copy_(rows)
        if padded > bs:
            self.rows[:, bs:padded].copy_(self.pad.expand(-1, padded - bs))
        # NOTE: as the executor's replays: MoE layers over DP groups gather agreed rows
        with self.executor.ctx.parallel.rows_agreed():
            emitted, accepted = graphs.run(ForwardMode.VERIFY, bt, VARIANT, rows=agreed)
        return accepted[::k1], emitted.view(bs, k1)

    def _step(self, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured step (module docstring) -> (emitted [bs * (k + 1)], accepted
        repeated per token [bs * (k + 1)]): graph outputs are per token."""
        bs, k1, ps, table = batch.batch_size, self.k + 1, self.page_size, self.table
        slot, floats, placeholder, last_pos = self.rows[:, :bs]
        pos = batch.positions.view(bs, k1)
        host_start = pos[:, 0].clone()  # NOTE: not a view: the positions move below
        start = torch.where(floats.bool(), table.next_pos[slot], host_start)
        shift = start - host_start
        moved = pos + shift[:, None]
        page = batch.page_table.gather(1, moved // ps)
        batch.out_cache_loc.copy_((page * ps + moved % ps).view(-1))
        batch.positions.copy_(moved.view(-1))
        batch.seq_lens.add_(shift)
        ids = batch.input_ids.view(bs, k1)
        ids[:, 0] = torch.where(placeholder.bool(), table.last_tokens[slot], ids[:, 0])
        ids[:, 1:] = table.draft_tokens[slot]
        backend = batch.attn_backend
        if not backend.supports_cuda_graph:  # NOTE: static replay: its metadata read lengths
            batch.attn_meta = backend.build_metadata(batch)
        _, argmax, aux = self.executor.token_logits(batch)
        acc = greedy_verify(argmax.view(bs, k1), ids[:, 1:])
        table.last_tokens.index_copy_(0, slot, acc.last_token_ids)
        table.next_pos.index_copy_(0, slot, start + 1 + acc.accept_len)
        ext = self.drafter.extend_view(batch, acc.token_ids.clamp_min(0).view(-1))
        drafts = self.drafter.verify_round(ext, aux, acc.accept_len, last_pos)
        table.draft_tokens.index_copy_(0, slot, drafts)
        return acc.token_ids.view(-1), acc.accept_len.repeat_interleave(k1)
