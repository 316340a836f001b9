"""Per-request changes to the logits before sampling: `logit_bias`,
`allowed_token_ids`, `min_tokens` and a structured-output grammar.

Semantics (on raw float32 logits, before penalties and temperature; reported
logprobs stay those of the raw logits, as for penalties):
  * logit_bias {id: b}: b is added to the logit of token id (OpenAI; b in [-100, 100]).
  * allowed_token_ids A: every token outside A gets -inf (vLLM).
  * min_tokens m: while fewer than m tokens have been generated, the stop tokens
    (eos unless ignore_eos, and stop_token_ids) get -inf (vLLM), so the output
    cannot end on a token before its m-th token.
  * a grammar (grammar_state.py): every token its bitmask does not allow gets -inf.

A request's static part (bias and allowed set) is one [vocab] row built on the
device once; a step stacks the rows of the batch rows that need any change and
adds them with one `index_add`, after masking the stop tokens of the rows still
under their `min_tokens` with one `index_fill` and the tokens their grammars refuse
with one bitmask, uploaded once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gyrfalcon.forward.host_copy import upload
from gyrfalcon.ipc.messages import SamplingParams
from gyrfalcon.worker.grammar_state import allowed_tokens


def static_row(params: SamplingParams, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[vocab] float32: logit_bias added, -inf outside allowed_token_ids (0 elsewhere).

    NOTE: ids outside the model's vocabulary are dropped: the frontend checks ids
    against the tokenizer, whose vocabulary may be a little larger than the model's.
    """
    row = torch.zeros(vocab_size, dtype=torch.float32)
    if params.allowed_token_ids is not None:
        allowed = [t for t in params.allowed_token_ids if 0 <= t < vocab_size]
        row.fill_(float("-inf"))
        row[torch.tensor(allowed, dtype=torch.int64)] = 0.0
    for token_id, bias in params.logit_bias.items():
        if 0 <= token_id < vocab_size:
            row[token_id] += bias
    return row.to(device)


def stop_ids(params: SamplingParams, eos_token_ids: Sequence[int]) -> list[int]:
    """The tokens that would end the output: what `min_tokens` holds back."""
    eos = () if params.ignore_eos else tuple(eos_token_ids)
    return sorted(set(params.stop_token_ids) | set(eos))


@dataclass
class LogitAdjust:
    """The logit changes of one step, for the batch rows that have any."""

    rows: torch.Tensor  # [na] int64, batch row of each adjusted row
    add: torch.Tensor  # [na, vocab] float32, added to those rows' logits


def build_logit_adjust(
    rows: list[int],
    static: list[torch.Tensor | None],
    suppress: list[list[int]],
    vocab_size: int,
    device: torch.device,
    bitmask: torch.Tensor | None = None,
) -> LogitAdjust:
    """rows[j]'s change = static[j] (None: zeros) with -inf at the ids suppress[j] and,
    with a bitmask [len(rows), words] int32 on the host, where its row j's bit is 0."""
    assert len(rows) == len(static) == len(suppress), "one entry per adjusted row"
    zeros = None
    parts = []
    for s in static:
        if s is None:
            if zeros is None:
                zeros = torch.zeros(vocab_size, dtype=torch.float32, device=device)
            s = zeros
        parts.append(s)
    add = torch.stack(parts)  # [na, vocab], a new tensor
    flat = [j * vocab_size + t for j, ids in enumerate(suppress) for t in ids if t < vocab_size]
    if flat:
        add.view(-1).index_fill_(0, upload(flat, torch.int64, device), float("-inf"))
    if bitmask is not None:
        assert bitmask.shape[0] == len(rows), "one bitmask row per adjusted row"
        if device.type == "cuda":
            bitmask = bitmask.pin_memory()  # NOTE: the copy below does not wait
        allowed = allowed_tokens(bitmask.to(device, non_blocking=True), vocab_size)
        add.masked_fill_(~allowed, float("-inf"))
    return LogitAdjust(rows=upload(rows, torch.int64, device), add=add)


def apply_logit_adjust(logits: torch.Tensor, adjust: LogitAdjust | None) -> torch.Tensor:
    """float32 logits [bs, vocab] with `adjust` added; `logits` itself is never modified."""
    logits = logits.float()
    if adjust is None:
        return logits
    return logits.index_add(0, adjust.rows, adjust.add)  # out of place: a new tensor
