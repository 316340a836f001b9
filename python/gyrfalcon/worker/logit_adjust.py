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
    A grammar decides where the output ends: `min_tokens` does not apply to its rows.

A request's static part (bias and allowed set) is one [vocab] row built on the
device once; a step stacks the rows of the batch rows that need any change and
adds them with one `index_add`, after masking the stop tokens of the rows still
under their `min_tokens` with one `index_fill`. The tokens the grammar rows'
masks refuse get -inf in place from the step's bitmask (uploaded by `prepare`),
by xgrammar's kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from gyrfalcon.forward.host_copy import upload
from gyrfalcon.ipc.messages import SamplingParams
from gyrfalcon.worker.grammar_state import apply_bitmask


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

    rows: torch.Tensor | None  # [na] int64, batch row of each added row (None: none)
    add: torch.Tensor | None  # [na, vocab] float32, added to those rows' logits
    # the grammar rows: [bs, words] int32 bitmask whose rows mask_rows [nm] apply
    bitmask: torch.Tensor | None = None
    mask_rows: torch.Tensor | None = None


def build_logit_adjust(
    rows: list[int],
    static: list[torch.Tensor | None],
    suppress: list[list[int]],
    vocab_size: int,
    device: torch.device,
    bitmask: torch.Tensor | None = None,
    mask_rows: list[int] | None = None,
) -> LogitAdjust:
    """rows[j]'s change = static[j] (None: zeros) with -inf at the ids suppress[j]; and
    each batch row r in mask_rows keeps only the tokens whose bit is set in row r of
    `bitmask` ([bs, words] int32 on `device`)."""
    assert len(rows) == len(static) == len(suppress), "one entry per adjusted row"
    adjust = LogitAdjust(rows=None, add=None)
    if mask_rows:
        assert bitmask is not None and bitmask.shape[0] > max(mask_rows), "a mask per row"
        adjust.bitmask, adjust.mask_rows = bitmask, upload(mask_rows, torch.int64, device)
    if not rows:
        return adjust
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
    adjust.rows, adjust.add = upload(rows, torch.int64, device), add
    return adjust


def apply_logit_adjust(logits: torch.Tensor, adjust: LogitAdjust | None) -> torch.Tensor:
    """float32 logits [bs, vocab] with `adjust` applied; `logits` itself is never modified."""
    if adjust is None:
        return logits.float()
    if adjust.add is not None:
        out = logits.float().index_add(0, adjust.rows, adjust.add)  # out of place: new
    else:
        out = logits.to(torch.float32, copy=True)
    if adjust.bitmask is not None:
        apply_bitmask(out, adjust.bitmask, adjust.mask_rows)  # in place, on the copy
    return out
