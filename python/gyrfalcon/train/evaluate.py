"""A batch through the unrolled drafter (`run_batch`: the training step's forward and
loss) and the drafter's acceptance on held-out sequences (`evaluate`), per unroll step
and in rounds walked as a server walks them."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from gyrfalcon.models.llama_eagle3 import LlamaForCausalLMEagle3
from gyrfalcon.train.args import TrainArgs
from gyrfalcon.train.features import Features, TrainBatch
from gyrfalcon.train.objective import (
    StepResult,
    TargetView,
    acceptance_length,
    served_rounds,
    ttt_loss,
)
from gyrfalcon.train.ttt import ttt_unroll


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bfloat16 autocast on CUDA (float32 master weights); float32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def run_batch(
    drafter: LlamaForCausalLMEagle3,
    target: torch.nn.Module,
    batch: TrainBatch,
    args: TrainArgs,
    device: torch.device,
) -> tuple[torch.Tensor, list[StepResult]]:
    """(weighted loss, per-step results) of the unrolled drafter on one batch."""
    view = TargetView.of(
        target, batch.final, drafter.draft_to_target, batch.target_argmax,
        args.target_temperature,
    )  # fmt: skip
    aux = batch.aux if device.type == "cuda" else batch.aux.float()
    with autocast(device):
        outs = ttt_unroll(drafter, batch.ids, aux, args.ttt_steps)
        return ttt_loss(drafter, outs, view, batch.rows, args.step_loss_decay, args.reach_weight)


@dataclass
class Acceptance:
    """A drafter measured on held-out sequences (`evaluate`)."""

    rates: list[float]  # per unroll step, given the earlier drafts were right
    served_length: float  # tokens per verify step of rounds over the sequences (`served_rounds`)
    # per sequence, in order: (verify steps, tokens they emit) of its rounds
    rounds: list[tuple[int, int]] = field(default_factory=list)

    @property
    def length(self) -> float:
        """The mean acceptance length the rates imply (`acceptance_length`)."""
        return acceptance_length(self.rates)


@torch.no_grad()
def evaluate(
    drafter: LlamaForCausalLMEagle3,
    target: torch.nn.Module,
    features: Features,
    args: TrainArgs,
    device: torch.device,
) -> Acceptance:
    """Acceptance per unroll step over the held-out sequences, and the tokens per verify
    step of speculative rounds of k = --ttt-steps drafts over them."""
    hits = [0] * args.ttt_steps
    rows = [0] * args.ttt_steps
    per_seq: list[tuple[int, int]] = []
    for lo in range(0, len(features), args.batch_size):
        idx = list(range(lo, min(lo + args.batch_size, len(features))))
        batch = features.batch(idx, args.seq_bucket, args.ttt_steps)
        _, results = run_batch(drafter, target, batch, args, device)
        for j, r in enumerate(results):
            hits[j] += int(r.hits)
            rows[j] += r.rows
        maps = torch.stack([r.hit_map for r in results], dim=1).cpu()  # [B, k, S]
        for i, seq in enumerate(idx):
            per_seq.append(served_rounds(maps[i], features.prompt_lens[seq], features.lengths[seq]))
    rates = [h / max(1, n) for h, n in zip(hits, rows)]
    steps, emitted = sum(r[0] for r in per_seq), sum(r[1] for r in per_seq)
    return Acceptance(rates, emitted / max(1, steps), per_seq)


def report(step: int, acc: Acceptance) -> str:
    per_step = ", ".join(f"{r:.3f}" for r in acc.rates)
    return (
        f"step {step}: held-out acceptance per draft step [{per_step}], mean acceptance "
        f"length {acc.length:.2f} (k={len(acc.rates)}), {acc.served_length:.2f} in rounds "
        "as served"
    )
