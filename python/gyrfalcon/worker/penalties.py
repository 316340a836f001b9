"""Repetition, presence and frequency penalties for the sampler.

Semantics (applied to raw float32 logits, before temperature):
  * repetition_penalty r (HF/CTRL style): for every token that appears in the
    prompt OR the output so far, a logit > 0 is divided by r, a logit < 0 is
    multiplied by r.
  * presence_penalty p (OpenAI): subtract p once from every token that appears
    in the OUTPUT so far.
  * frequency_penalty f (OpenAI): subtract f * count from every token, where
    count is its number of occurrences in the OUTPUT so far.
Repetition is applied first, then presence and frequency.

Only the batch rows that carry a non-default penalty get [rows, vocab] count
tensors; they are built on the device with scatter_add from token ids that are
mirrored on the device incrementally (`DeviceTokenBuffer`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyrfalcon.forward.host_copy import host_tensor, upload


class DeviceTokenBuffer:
    """Append-only device mirror of a Python list of token ids.

    Each `sync` uploads only the ids appended since the previous call, so a
    request's prompt is uploaded once and its output one token per step.

    NOTE: the mirrored list must only grow by appending. Truncation is detected
    (the buffer is rebuilt), but an in-place edit of an already-mirrored id is
    not; call `invalidate()` after such an edit.
    """

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None  # [capacity] int64 on self._device
        self._device: torch.device | None = None
        self._len = 0  # ids of the list already mirrored in self._buf[:self._len]

    def invalidate(self) -> None:
        """Forget the mirrored ids; the next `sync` uploads the whole list."""
        self._buf, self._device, self._len = None, None, 0

    def sync(self, ids: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
        """Return a [len(ids)] int64 tensor on `device` equal to `ids`.

        Raises ValueError if a newly mirrored id is outside [0, vocab_size).
        """
        n = len(ids)
        if self._device != device or n < self._len:
            self.invalidate()
        if n > self._len:
            new = ids[self._len :]
            if min(new) < 0 or max(new) >= vocab_size:
                raise ValueError(f"token id outside [0, {vocab_size}) in {new}")
            cap = 0 if self._buf is None else self._buf.numel()
            if n > cap:
                grown = torch.empty(max(n, 2 * cap, 64), dtype=torch.int64, device=device)
                if self._len:
                    grown[: self._len].copy_(self._buf[: self._len])  # type: ignore[index]
                self._buf, self._device = grown, device
            dst = self._buf[self._len : n]  # type: ignore[index]
            dst.copy_(host_tensor(new, torch.int64, device), non_blocking=True)
            self._len = n
        if self._buf is None:
            return torch.empty(0, dtype=torch.int64, device=device)
        return self._buf[:n]


@dataclass
class PenaltyTensors:
    """Penalty state of the batch rows that carry any non-default penalty."""

    rows: torch.Tensor  # [np] int64, batch row of each penalized row
    repetition: torch.Tensor  # [np] float32 (1.0 = off)
    presence: torch.Tensor  # [np] float32 (0.0 = off)
    frequency: torch.Tensor  # [np] float32 (0.0 = off)
    output_counts: torch.Tensor  # [np, vocab] float32, occurrences in the output so far
    seen: torch.Tensor | None  # [np, vocab] bool, in prompt or output; None if no r != 1


def _flat_positions(
    ids: list[torch.Tensor], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    """Flat indices row * vocab + id into a [len(ids), vocab] tensor; None if no ids."""
    lens = [t.numel() for t in ids]
    total = sum(lens)
    if total == 0:
        return None
    flat_ids = torch.cat(ids)  # [total]
    # NOTE: output_size avoids the device->host sync repeat_interleave needs otherwise.
    row_of = torch.repeat_interleave(
        torch.arange(len(ids), device=device), upload(lens, torch.int64, device), output_size=total
    )  # [total]
    return row_of * vocab_size + flat_ids


def build_penalty_tensors(
    rows: list[int],
    params: list[tuple[float, float, float]],
    prompts: list[torch.Tensor],
    outputs: list[torch.Tensor],
    vocab_size: int,
    device: torch.device,
) -> PenaltyTensors:
    """Build the penalty tensors of the penalized rows.

    rows: batch rows; params: (repetition, presence, frequency) per row;
    prompts / outputs: [len] int64 device tensors of each row's token ids.
    """
    n = len(rows)
    if n == 0:
        raise ValueError("build_penalty_tensors needs at least one penalized row")
    rep = [p[0] for p in params]
    scalars = upload([list(p) for p in zip(*params)], torch.float32, device)  # [3, np]
    counts = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)  # [np, vocab]
    out_pos = _flat_positions(outputs, vocab_size, device)
    if out_pos is not None:
        counts.view(-1).scatter_add_(
            0, out_pos, torch.ones(out_pos.numel(), dtype=torch.float32, device=device)
        )
    seen = None
    if any(r != 1.0 for r in rep):
        seen = counts > 0  # [np, vocab]
        prompt_pos = _flat_positions(prompts, vocab_size, device)
        if prompt_pos is not None:
            seen.view(-1).index_fill_(0, prompt_pos, True)
    return PenaltyTensors(
        rows=upload(rows, torch.int64, device),
        repetition=scalars[0],
        presence=scalars[1],
        frequency=scalars[2],
        output_counts=counts,
        seen=seen,
    )


def apply_penalty_tensors(logits: torch.Tensor, pen: PenaltyTensors | None) -> torch.Tensor:
    """Return penalized float32 logits [bs, vocab]; `logits` itself is never modified."""
    logits = logits.float()
    if pen is None:
        return logits
    sub = logits.index_select(0, pen.rows)  # [np, vocab], a copy
    if pen.seen is not None:
        r = pen.repetition[:, None]  # [np, 1]
        sub = torch.where(pen.seen, torch.where(sub > 0, sub / r, sub * r), sub)
    counts = pen.output_counts
    sub = sub - pen.frequency[:, None] * counts - pen.presence[:, None] * (counts > 0).float()
    return logits.index_copy(0, pen.rows, sub)
