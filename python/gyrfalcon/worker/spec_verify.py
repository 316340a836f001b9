"""Sampling of a step whose rows verify drafts: the target's logits at every verified
position -> what each sampling row emits (`Acceptance`) and the logprobs of the
emitted tokens. No host sync.

Row i of the step's S sampling rows has d_i drafts (0 for rows without, e.g. a
prefill's last chunk or a penalized request) and 1 + d_i logit rows, consecutive
from `logit_starts[i]`. The rows are laid out padded, [S, K1] with K1 = max d_i + 1
(`padded_index`); position m of row i is its (n_i + m + 1)-th output token, so
`min_tokens` is applied per position (`prepare` of the expanded rows), and so is a
grammar, its mask at position m following the row's first m drafts (a draft it
refuses is rejected: grammar_state.py). Greedy
batches compare argmaxes (`greedy_verify`); others draw by exact rejection
sampling against the drafter's greedy proposal, q = one-hot(d) (`rejection_sample`):
d is accepted with probability p(d), a rejection draws from p without d.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyrfalcon.kernels.dispatch import KernelPolicy
from gyrfalcon.worker.logprobs import SampleOutput, raw_logprobs
from gyrfalcon.worker.sampler import (
    RequestSamplingState,
    apply_penalties,
    argmax_rows,
    is_greedy,
    prepare,
    sampling_probs,
)
from gyrfalcon.worker.spec_accept import Acceptance, greedy_verify, rejection_sample


def padded_index(num_drafts: list[int], width: int) -> list[int]:
    """For each padded position (i, m), m < width, of rows with num_drafts[i] drafts:
    the logit row it reads, rows' logit rows being consecutive (1 + d_i each).
    Positions past a row's drafts repeat its last logit row (never accepted there).

    >>> padded_index([2, 0], 3)
    [0, 1, 2, 3, 3, 3]
    """
    out, start = [], 0
    for d in num_drafts:
        assert 0 <= d < width, (d, width)
        out.extend(start + min(m, d) for m in range(width))
        start += d + 1
    return out


def emitted_index(num_drafts: list[int], width: int) -> list[int]:
    """For each logit row: its padded position i * width + m (`padded_index`'s inverse
    on the real positions).

    >>> emitted_index([2, 0], 3)
    [0, 1, 2, 3]
    """
    return [i * width + m for i, d in enumerate(num_drafts) for m in range(d + 1)]


@dataclass
class VerifyIndex:
    """The step's host layout of its sampling rows, uploaded with the step."""

    num_drafts: list[int]  # d_i per sampling row
    width: int  # K1 = max d_i + 1
    padded: torch.Tensor  # [S * K1] `padded_index`
    emitted: torch.Tensor  # [N] `emitted_index`
    num_drafts_t: torch.Tensor  # [S] d_i


PROBS_CHUNK_ELEMS = 1 << 24  # logit rows x vocab whose sampling probabilities are made at once


def probs_in_chunks(
    logits: torch.Tensor,
    states: list[RequestSamplingState],
    generated: list[int],
    after: list[list[int]] | None,
    kernels: KernelPolicy,
) -> torch.Tensor:
    """`sampling_probs` of logits [n, vocab] for row i's `states[i]`, `generated[i]`,
    `after[i]` (`prepare`'s arguments), made PROBS_CHUNK_ELEMS // vocab rows at a time
    (each chunk with its own `prepare`) into one float32 tensor where there are more
    rows: the float32 copies the sampler makes (penalized, tempered, sorted, ...) then
    hold a chunk each, not every row's. A row's probabilities depend on that row alone,
    so the chunks change no value."""
    n, vocab = logits.shape
    rows = max(1, PROBS_CHUNK_ELEMS // vocab)
    if n <= rows:
        batch = prepare(states, vocab, logits.device, generated, after)
        return sampling_probs(logits, batch, kernels)
    out = torch.empty(n, vocab, dtype=torch.float32, device=logits.device)
    for s in range(0, n, rows):
        e = min(n, s + rows)
        part = prepare(states[s:e], vocab, logits.device, generated[s:e], after and after[s:e])
        out[s:e] = sampling_probs(logits[s:e], part, kernels)
    return out


def verify_sample(
    logits: torch.Tensor,
    argmax: torch.Tensor | None,
    states: list[RequestSamplingState],
    num_generated: list[int],
    draft_ids: torch.Tensor,
    idx: VerifyIndex,
    vocab_size: int,
    kernels: KernelPolicy,
) -> tuple[Acceptance, SampleOutput]:
    """logits: [N, vocab] the target's at every logit row; argmax: [N] their argmax if a
    graph computed it; states / num_generated: per sampling row (tokens generated
    before its first position); draft_ids: [S, >= K1 - 1] each row's drafts (target
    ids; columns past d_i ignored). Returns (what each row emits, a SampleOutput over
    the N logit rows: the token each emitted there (padding where none) and, if any
    row asks, the raw logprobs)."""
    s, k1 = len(states), idx.width
    device = logits.device
    full = sum(idx.num_drafts) == s * (k1 - 1)  # NOTE: no padding: skip the gathers
    drafts = draft_ids[:, : k1 - 1]
    greedy = all(is_greedy(st.params) for st in states)
    # NOTE: greedy rows that change no logit (a mixed step's common case) read the graph's
    # argmax where it made one: no padded logits, no SamplingBatch
    plain = greedy and not any(st.has_penalty or st.adjusts_logits for st in states)
    if plain and argmax is not None:
        top = argmax if full else argmax[idx.padded]
        acc = greedy_verify(top.view(s, k1), drafts, idx.num_drafts_t)
    else:
        padded = logits if full else logits[idx.padded]  # [S * K1, vocab]
        expanded = [st for st in states for _ in range(k1)]
        generated = [n + m for n in num_generated for m in range(k1)]
        after = None  # NOTE: a grammar's mask at position m follows the row's first m drafts
        if any(st.grammar is not None for st in states):
            host = drafts.tolist()  # NOTE: a host sync, in steps with a grammar row only
            after = [host[i][: min(m, d)] for i, d in enumerate(idx.num_drafts) for m in range(k1)]
        if greedy:
            if not plain:
                padded = apply_penalties(
                    padded, prepare(expanded, vocab_size, device, generated, after)
                )
            acc = greedy_verify(argmax_rows(padded, kernels).view(s, k1), drafts, idx.num_drafts_t)
        else:
            p = probs_in_chunks(padded, expanded, generated, after, kernels)
            p = p.view(s, k1, vocab_size)
            rows = prepare(states, vocab_size, device, num_generated, masks=False)  # draws only
            # NOTE: q None: the drafter proposes greedily (one-hot q, never materialized)
            acc = rejection_sample(p, None, drafts, rows, kernels, idx.num_drafts_t)
    chosen_ids = acc.token_ids.view(-1)[idx.emitted]  # [N]
    asked = [st.params.logprobs for st in states if st.params.logprobs is not None]
    if not asked:
        return acc, SampleOutput(chosen_ids, None, None, None)
    k = min(max(asked), vocab_size)
    chosen, top_ids, top_lp = raw_logprobs(logits, chosen_ids.clamp_min(0), k)
    return acc, SampleOutput(chosen_ids, chosen, top_ids, top_lp)
