"""What the drafter learns from: the target's hidden states at every position.

One PREFILL forward of the target over whole sequences (the engine's own model,
paged KV cache and extend attention backend, `forward_aux`) gives, per token, the
three aux hidden states the drafter's fc reads (`DraftConfig.aux_layer_ids`: the
inputs of those layers), the final (normed) hidden state, from which the target's
logits at the draft ids are recomputed per batch (H numbers a token instead of a
vocabulary's worth), and the target's argmax over its whole vocabulary (what a draft
must match). No gradient reaches the target.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.host_copy import upload_tensor
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import RowInput, build_batch_tensors
from gyrfalcon.ipc.contract import DUMMY_PAGE
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.base import AttentionBackend
from gyrfalcon.train.data import TrainSequence
from gyrfalcon.train.rows import ScoredRows, plan_rows


def bucketed(length: int, bucket: int) -> int:
    """`length` rounded up to a multiple of `bucket`: a batch's padded length."""
    return -(-length // bucket) * bucket


@dataclass
class TrainBatch:
    """B sequences padded to S (padding repeats each sequence's last token; no counted
    row reads it: row p attends to rows <= p, `ttt`, and counts only while the token
    it predicts exists, `rows`), and the target at the positions that score the loss."""

    ids: torch.Tensor  # [B, S] int64
    aux: torch.Tensor  # [B, S, 3 * Ht] the target's aux hidden states
    final: torch.Tensor  # [m, Ht] the target's final normed hidden state at the scoring positions
    target_argmax: torch.Tensor  # [m] int64 the target's argmax over its vocabulary there
    rows: ScoredRows  # the union rows of the unroll steps, and which of `final` scores each


@dataclass
class Features:
    """The target states of a set of sequences, flat: sequence i is rows
    starts[i] .. starts[i] + lengths[i] - 1."""

    ids: torch.Tensor  # [N] int64
    aux: torch.Tensor  # [N, 3 * Ht]
    final: torch.Tensor  # [N, Ht]
    target_argmax: torch.Tensor  # [N] int64: argmax of compute_logits(final), the whole vocabulary
    starts: list[int]
    lengths: list[int]
    prompt_lens: list[int]

    def __len__(self) -> int:
        return len(self.starts)

    def batch(self, indices: Sequence[int], bucket: int = 1, steps: int = 1) -> TrainBatch:
        """The sequences at `indices`, padded to their longest length rounded up to a
        multiple of `bucket`, scored over `steps` unroll steps (`rows.plan_rows`). The
        index lists are built on the host and reach the device in one copy that does
        not wait for the device (no sync a step).

        NOTE: few distinct S, few shapes: on an H100, SDPA runs cuDNN attention (torch
        2.11 and its cuDNN 9.19), which builds an execution plan for each new
        (B, S, key length), forward and backward; an S per sequence length is the
        likely cause of the slow first steps of the measured run (docs/train_eagle3.md)."""
        device = self.ids.device
        lengths = [self.lengths[i] for i in indices]
        starts = torch.tensor([self.starts[i] for i in indices], dtype=torch.int64)
        plan = plan_rows(lengths, [self.prompt_lens[i] for i in indices], steps)
        seq_len = bucketed(max(lengths), bucket)
        span = torch.arange(seq_len)
        rows = starts[:, None] + torch.minimum(span[None, :], plan.lengths[:, None] - 1)  # [B, S]
        parts = [
            rows.flatten(),
            starts[plan.target_seq] + plan.target_pos,  # the scoring positions' feature rows
            *plan.row_arrays(seq_len),
        ]
        on_device = upload_tensor(torch.cat(parts), device)  # NOTE: one copy, no wait
        flat_rows, target_rows, *scored = on_device.split([len(x) for x in parts])
        b = len(indices)
        return TrainBatch(
            ids=self.ids.index_select(0, flat_rows).view(b, seq_len),
            aux=self.aux.index_select(0, flat_rows).view(b, seq_len, -1),
            final=self.final.index_select(0, target_rows),
            target_argmax=self.target_argmax.index_select(0, target_rows),
            rows=ScoredRows(*scored),
        )


@dataclass(frozen=True)
class TargetRunner:
    """The target as the engine holds it: model, paged KV cache (free between
    requests), the extend attention backend, and how many tokens one forward takes."""

    model: torch.nn.Module
    kv_cache: KVCache
    backend: AttentionBackend
    page_size: int
    max_tokens: int

    # NOTE: inference mode, as the engine runs: its backends' buffers are inference
    # tensors (the flashinfer plan updates them in place)
    @torch.inference_mode()
    def forward_aux(
        self, seqs: Sequence[list[int]], aux_layers: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One PREFILL over the sequences (fresh requests, pages 1..) -> (aux [T, 3 Ht]
        in aux_layers' order, final [T, Ht]), T their tokens in order."""
        rows, next_page = [], DUMMY_PAGE + 1
        for ids in seqs:
            n = -(-len(ids) // self.page_size)
            rows.append(RowInput(0, list(ids), list(range(next_page, next_page + n))))
            next_page += n
        assert next_page <= self.kv_cache.num_pages, "the group needs more KV pages"
        device = self.kv_cache.k.device
        bt = build_batch_tensors(rows, self.page_size, device)
        batch = ForwardBatch.from_tensors(
            ForwardMode.PREFILL, bt, self.page_size, self.kv_cache, self.backend
        )
        batch.attn_meta = self.backend.build_metadata(batch)
        final, aux = self.model.forward_aux(batch, aux_layers)
        return torch.cat(aux, dim=-1), final

    def groups(self, seqs: Sequence[TrainSequence]) -> list[list[int]]:
        """Indices of seqs in forward-sized groups: at most max_tokens tokens (a longer
        sequence alone) and the KV pages there are."""
        pages_free = self.kv_cache.num_pages - 1  # NOTE: page 0 is the dummy page
        out: list[list[int]] = [[]]
        tokens = pages = 0
        for i, s in enumerate(seqs):
            n, p = len(s.ids), -(-len(s.ids) // self.page_size)
            if p > pages_free:
                raise ValueError(
                    f"a sequence of {n} tokens needs {p} KV pages; there are "
                    f"{pages_free}: raise --kv-cache-memory"
                )
            if out[-1] and (tokens + n > self.max_tokens or pages + p > pages_free):
                out.append([])
                tokens = pages = 0
            out[-1].append(i)
            tokens, pages = tokens + n, pages + p
        return [g for g in out if g]


def compute_features(
    runner: TargetRunner,
    seqs: Sequence[TrainSequence],
    aux_layers: Sequence[int],
    device: torch.device,
    desc: str = "target features",
) -> Features:
    """The target's states for every token of seqs, stored on `device` in the
    target's dtype."""
    lengths = [len(s.ids) for s in seqs]
    starts = [0, *itertools.accumulate(lengths)][:-1]
    total = sum(lengths)
    ids = torch.tensor([t for s in seqs for t in s.ids], dtype=torch.int64, device=device)
    argmax = torch.empty_like(ids)
    aux = final = None
    bar = tqdm(total=total, desc=desc, unit="tok")
    for group in runner.groups(seqs):
        a, f = runner.forward_aux([seqs[i].ids for i in group], aux_layers)
        if aux is None or final is None:  # NOTE: normal tensors, usable under autograd
            aux = torch.empty(total, a.shape[-1], dtype=a.dtype, device=device)
            final = torch.empty(total, f.shape[-1], dtype=f.dtype, device=device)
        lo = starts[group[0]]
        hi = lo + a.shape[0]
        aux[lo:hi], final[lo:hi] = a, f
        with torch.no_grad():  # NOTE: once here, not at every step that reads the position
            argmax[lo:hi] = runner.model.compute_logits(f).argmax(-1)
        bar.update(hi - lo)
    bar.close()
    assert aux is not None and final is not None, "no sequences"
    return Features(ids, aux, final, argmax, starts, lengths, [s.prompt_len for s in seqs])
