"""The loss of the unrolled drafter against the target, and acceptance.

Row p of unroll step j predicts the token at p + 2 + j; the target's distribution
for it is the target's logits at position q = p + 1 + j (`ttt` has the layout).
Rows count where that token is an answer token of the sequence (`rows`: the batch
carries the union of the steps' rows, each step keeps its own).

Loss (EAGLE3): at each step, the cross-entropy of the drafter's distribution
against the target's restricted to the draft vocabulary (softmax of the target's
logits at the draft ids, divided by --target-temperature, 1 by default), over rows
whose target argmax is in the draft vocabulary (elsewhere the draft vocabulary
cannot express the target's choice); step j weighted decay ** j. With
--reach-weight w > 0, row p of step j >= 1 also weighs (1 - w) + w * reached, where
reached says the drafter's argmax was the target's at every earlier step of that row:
a server only verifies draft j + 1 of a round whose first j drafts were accepted, so
w = 1 trains each later step on the rows a greedy server reaches (token-alignable
training), 0 (the default) on every row alike.

Acceptance at step j: the fraction of rows where the drafter's argmax, mapped to a
target id, equals the target's argmax over the whole vocabulary. The inputs of step
j are the true tokens, so it is the chance of accepting draft token j + 1 given
the first j were accepted; the mean acceptance length of a round of k drafts is
1 + sum_{j<k} prod_{i<=j} acc_i (`acceptance_length`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gyrfalcon.kernels.soft_cross_entropy import soft_cross_entropy
from gyrfalcon.models.llama_eagle3 import LlamaForCausalLMEagle3
from gyrfalcon.train.features import Features
from gyrfalcon.train.rows import ScoredRows
from gyrfalcon.train.ttt import draft_logits


@dataclass
class TargetView:
    """The target's choices at the positions that score a batch (`TrainBatch.final`)."""

    logits: torch.Tensor  # [m, draft_vocab] the target's logits at the draft ids
    argmax: torch.Tensor  # [m] target ids: argmax over the whole vocabulary

    @classmethod
    @torch.no_grad()
    def of(
        cls,
        target: torch.nn.Module,
        final: torch.Tensor,
        draft_to_target: torch.Tensor,
        argmax: torch.Tensor,
        temperature: float = 1.0,
    ) -> TargetView:
        """final: [m, Ht] the target's final normed hidden states; argmax: [m] its argmax
        over the whole vocabulary there (`Features.target_argmax`, computed once). The
        logits are computed at the draft ids only: the LM head's rows there (the loss
        kernel takes their softmax), divided by `temperature` (the loss then learns
        softmax(logits / T); the argmax is unchanged)."""
        head = target.lm_head.rows(draft_to_target)  # [draft_vocab, Ht]
        logits = F.linear(final, head)
        return cls(logits if temperature == 1.0 else logits / temperature, argmax)


@dataclass
class StepResult:
    loss: torch.Tensor  # scalar, the mean cross-entropy over the scored rows (0 without)
    valid: torch.Tensor  # [n] bool: the union rows this step counts
    hit_rows: torch.Tensor  # [n] bool: counted and the drafter's argmax is the target's
    rows_of: ScoredRows  # where the union rows sit in the batch
    shape: tuple[int, int]  # the batch's [B, S]

    @property
    def rows(self) -> int:
        """Rows counted for acceptance (reads the device)."""
        return int(self.valid.sum())

    @property
    def hits(self) -> torch.Tensor:
        """Scalar int64: rows where the drafter's argmax is the target's."""
        return self.hit_rows.sum()

    @property
    def hit_map(self) -> torch.Tensor:
        """[B, S] bool: row p counted and its draft the target's argmax."""
        out = torch.zeros(self.shape, dtype=torch.bool, device=self.hit_rows.device)
        out[self.rows_of.seq, self.rows_of.pos] = self.hit_rows
        return out


def step_result(
    drafter: LlamaForCausalLMEagle3,
    out: torch.Tensor,
    view: TargetView,
    rows: ScoredRows,
    step: int,
    weight: torch.Tensor | None = None,
) -> StepResult:
    """Loss and acceptance of unroll step `step`'s output out [B, S, H]. The LM head
    runs on the union rows only (no host sync: the rows came from the host). weight
    [n] float: each union row's share of the loss (None: 1 each); the loss is the
    weighted mean over the scored rows."""
    valid, target_row = rows.at_step(step)
    # NOTE: index_select, whose backward is an index_add (the rows are distinct)
    logits = draft_logits(drafter, out.flatten(0, 1).index_select(0, rows.flat))  # [n, V]
    # NOTE: -sum(p log_softmax(logits)) per row and the drafter's argmax, fused on CUDA
    # (kernels/soft_cross_entropy.py)
    ce, draft_argmax = soft_cross_entropy(logits, view.logits, target_row)  # [n] float32
    target_ids = view.argmax.index_select(0, target_row)  # [n]
    hit_rows = (drafter.to_target_ids(draft_argmax) == target_ids) & valid
    # NOTE: the target's choice is drafted (else the draft vocabulary cannot express it)
    scored = ((drafter.target_to_draft(target_ids) >= 0) & valid).float()
    if weight is not None:
        scored = scored * weight
    loss = (ce * scored).sum() / scored.sum().clamp(min=1)
    return StepResult(loss, valid, hit_rows, rows, (out.shape[0], out.shape[1]))


def ttt_loss(
    drafter: LlamaForCausalLMEagle3,
    outs: list[torch.Tensor],
    view: TargetView,
    rows: ScoredRows,
    decay: float,
    reach_weight: float = 0.0,
) -> tuple[torch.Tensor, list[StepResult]]:
    """sum_j decay ** j * loss_j over the unroll steps, and each step's result; with
    reach_weight w, step j's rows weigh (1 - w) + w * (hit at every step before j)."""
    results: list[StepResult] = []
    reached: torch.Tensor | None = None  # [n] bool: every step so far hit
    for j, out in enumerate(outs):
        weight = None
        if reach_weight and reached is not None:
            weight = (1.0 - reach_weight) + reach_weight * reached.float()
        results.append(step_result(drafter, out, view, rows, j, weight))
        hit = results[-1].hit_rows
        reached = hit if reached is None else reached & hit
    zero = torch.zeros((), device=outs[0].device)  # NOTE: float32 even under autocast
    total = sum((decay**j * r.loss for j, r in enumerate(results)), zero)
    return total, results


def acceptance_length(rates: list[float]) -> float:
    """Mean tokens per round with len(rates) chained drafts accepted at these
    per-step rates (conditional on the earlier drafts' acceptance): 1 + sum_j prod_{i<=j}."""
    total, chain = 1.0, 1.0
    for r in rates:
        chain *= r
        total += chain
    return total


def served_rounds(hits: torch.Tensor, prompt_len: int, length: int) -> tuple[int, int]:
    """(verify steps, tokens they emit) of a server drafting k = len(hits) tokens a round
    over one sequence whose tokens are the target's greedy ones. hits [k, S] bool:
    hits[j, p], draft step j from row p (of the token at p + 2 + j) is the target's
    token (False past the sequence). The prefill emits the token at prompt_len; a
    round from row p (the target's token at p + 1 known) accepts its leading hits a and
    emits a + 1 tokens, clipped at the sequence's end as the server clips them at a
    finish; the next round starts from row p + a + 1.

    Tokens / verify steps is what a server reports (`usage.spec_accept_length`). It is
    below `acceptance_length` of the per-step rates: rounds start where the previous
    one failed, and failures cluster (the rates count every position alike)."""
    k = hits.shape[0]
    table = hits.tolist()
    p, steps, emitted = prompt_len - 1, 0, 0
    while p + 2 <= length - 1:  # NOTE: a token at p + 2 is still to come
        a = 0
        while a < k and table[a][p]:
            a += 1
        emitted += min(a + 1, length - 2 - p)
        steps += 1
        p += a + 1
    return steps, emitted


def greedy_agreement(features: Features) -> float:
    """The fraction of answer tokens that are the target's argmax at the position
    before them (`Features.target_argmax`, from the features' logits) against the
    engine's greedy answers: 1 up to rounding (a misaligned sequence or feature shows
    here first)."""
    hits = total = 0
    for start, n, prompt_len in zip(features.starts, features.lengths, features.prompt_lens):
        argmax = features.target_argmax[start + prompt_len - 1 : start + n - 1]
        answer = features.ids[start + prompt_len : start + n]
        hits += int((argmax == answer).sum())
        total += n - prompt_len
    return hits / max(1, total)
