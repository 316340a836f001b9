"""Token sampler of the model-runner worker.

Per step the worker calls `prepare(states, vocab, device, num_generated)` once,
then `sample(logits, batch)`. Pipeline per row (all in float32):

    logit_bias / allowed_token_ids / min_tokens / grammar (raw logits, logit_adjust.py)
      -> penalties -> temperature -> top_k -> top_p -> min_p -> draw

Greedy rows (temperature < 1e-5 or top_k == 1) take the argmax of the adjusted
and penalized logits and consume no RNG. Sampled rows draw with the Gumbel-max trick,
argmax(logits / T - log(E)) with E ~ Exponential(1) per vocab entry, which is a
draw from softmax(logits / T) without normalizing. Rows with a seed draw E from
their own generator, one row at a time, so a seeded row's token depends only on
its own logits and generator state, never on the rest of the batch; unseeded
rows share one batched draw from the default generator.

`sampling_probs(logits, batch)` returns the distribution `sample` draws from (one-hot on
greedy rows), for speculative decoding's acceptance (spec_accept.py).

Logprobs (chosen token + top-k) are always those of the model's raw distribution:
log_softmax of the raw logits in float32, before penalties and temperature.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from gyrfalcon.forward.host_copy import upload
from gyrfalcon.kernels.dispatch import DEFAULT_KERNELS, KernelPolicy
from gyrfalcon.worker.grammar_state import HostMasks, fill_masks, sync_all
from gyrfalcon.worker.logit_adjust import LogitAdjust, apply_logit_adjust, build_logit_adjust
from gyrfalcon.worker.logprobs import (
    SampleOutput,
    prompt_logprobs,
    raw_logprobs,
    to_position_logprobs,
)
from gyrfalcon.worker.penalties import (
    PenaltyTensors,
    apply_penalty_tensors,
    build_penalty_tensors,
)
from gyrfalcon.worker.sampling_state import (
    GREEDY_TEMPERATURE,
    RequestSamplingState,
    is_greedy,
)

__all__ = [
    "GREEDY_TEMPERATURE",
    "RequestSamplingState",
    "SampleOutput",
    "SamplingBatch",
    "apply_penalties",
    "gumbel_argmax",
    "is_greedy",
    "prepare",
    "prompt_logprobs",
    "row_draws",
    "sample",
    "sampling_probs",
    "to_position_logprobs",
]

HOST_MASKS = HostMasks()  # this process's grammar bitmasks on the host (one worker each)

# NOTE: top_p cut tolerance: a cumulative probability within this of top_p counts as having
# reached it, so that e.g. probs [0.5, ...] with top_p=0.5 keeps one token despite rounding.
_TOP_P_EPS = 1e-6


@dataclass
class SamplingBatch:
    """Per-step sampling parameters of a batch; built by `prepare`, tensors on device."""

    # NOTE: the five draw tensors are None when every row is greedy (nothing uploaded)
    temperatures: torch.Tensor | None  # [bs] float32 (1.0 on greedy rows)
    greedy: torch.Tensor | None  # [bs] bool
    top_k: torch.Tensor | None  # [bs] int64 (vocab_size = off)
    top_p: torch.Tensor | None  # [bs] float32 (1.0 = off)
    min_p: torch.Tensor | None  # [bs] float32 (0.0 = off)
    penalties: PenaltyTensors | None  # None when no row has a penalty
    adjust: LogitAdjust | None  # None when no row has logit_bias / allowed ids / min_tokens
    generators: list[torch.Generator | None]  # per row
    seeded_rows: list[int]  # sampled (non-greedy) rows with a generator
    vocab_size: int
    all_greedy: bool  # fast path: argmax only
    any_greedy: bool
    any_unseeded: bool  # some sampled row draws from the default generator
    do_top_k: bool  # some sampled row has top_k < vocab_size
    do_top_p: bool  # some sampled row has top_p < 1
    do_min_p: bool  # some sampled row has min_p > 0
    # [nt] int64: the sampled rows with top_k or top_p on (None if none); only these are sorted
    trunc_rows: torch.Tensor | None
    max_logprobs: int | None  # max top-k logprobs asked in the batch (None if nobody asked)

    @property
    def batch_size(self) -> int:
        return len(self.generators)


def prepare(
    states: list[RequestSamplingState],
    vocab_size: int,
    device: torch.device | str,
    num_generated: list[int] | None = None,
    after: list[list[int]] | None = None,
    masks: bool = True,
) -> SamplingBatch:
    """Build the step's `SamplingBatch` for `states` (row i = states[i]).

    num_generated[i]: the tokens row i's request has generated before this sample
    (for `min_tokens`); None = every request's `output_ids` so far.
    after[i]: the tokens between row i's output so far and its sample (a verify
    position's drafts), which its grammar's mask follows (None: none).
    masks: build grammar masks (False: a batch only drawn from, never masked).
    NOTE: a row with a grammar reads its `output_ids`: the steps before must be in.
    """
    device = torch.device(device)
    greedy = [s.greedy for s in states]
    sampled_rows = [i for i, g in enumerate(greedy) if not g]
    floats: list[torch.Tensor | None] = [None] * 3
    ints: list[torch.Tensor | None] = [None] * 2
    trunc: list[int] = []
    do_top_k = do_top_p = do_min_p = False
    if sampled_rows:  # NOTE: an all-greedy batch (the common one) builds none of these
        params = [s.params for s in states]
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy)]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]
        top_p = [min(p.top_p, 1.0) for p in params]
        min_p = [p.min_p for p in params]
        floats = list(upload([temps, top_p, min_p], torch.float32, device).view(3, len(states)))
        ints = list(upload([top_k, [int(g) for g in greedy]], torch.int64, device).view(2, -1))
        trunc = [i for i in sampled_rows if top_k[i] < vocab_size or top_p[i] < 1]
        do_top_k = any(top_k[i] < vocab_size for i in sampled_rows)
        do_top_p = any(top_p[i] < 1.0 for i in sampled_rows)
        do_min_p = any(min_p[i] > 0.0 for i in sampled_rows)

    pen_rows = [i for i, s in enumerate(states) if s.has_penalty]
    penalties = None
    if pen_rows:
        pen_states = [states[i] for i in pen_rows]
        penalties = build_penalty_tensors(
            rows=pen_rows,
            params=[
                (s.params.repetition_penalty, s.params.presence_penalty, s.params.frequency_penalty)
                for s in pen_states
            ],
            prompts=[s.prompt_dev.sync(s.prompt_ids, vocab_size, device) for s in pen_states],
            outputs=[s.output_dev.sync(s.output_ids, vocab_size, device) for s in pen_states],
            vocab_size=vocab_size,
            device=device,
        )

    adjusting = [i for i, s in enumerate(states) if s.adjusts_logits]
    if adjusting and num_generated is None:
        num_generated = [len(s.output_ids) for s in states]
    adj_rows, static, suppress, constrained = [], [], [], []
    for i in adjusting:
        s = states[i]
        assert num_generated is not None
        # NOTE: a grammar decides where its output ends: min_tokens cannot hold back the
        # stop tokens of a complete grammar, which allows nothing else
        held = s.stop_ids if num_generated[i] < s.params.min_tokens and s.grammar is None else []
        row = s.static_row(vocab_size, device)
        if masks and s.grammar is not None:
            constrained.append(i)
        if row is not None or held:
            adj_rows.append(i)
            static.append(row)
            suppress.append(held)
    bitmask = None
    if constrained:  # NOTE: row i of the bitmask is batch row i's (others left as they are)
        bitmask = HOST_MASKS.take(len(states), vocab_size, device)
        entries, outputs = [], {}
        for i in constrained:
            grammar = states[i].grammar
            assert grammar is not None
            outputs[id(grammar)] = (grammar, states[i].output_ids)
            entries.append((i, grammar, after[i] if after is not None else []))
        sync_all(list(outputs.values()))
        fill_masks(bitmask, entries)
        bitmask = HOST_MASKS.upload(bitmask, device)
    asked = [s.params.logprobs for s in states if s.params.logprobs is not None]
    generators = [s.generator for s in states]
    seeded_rows = [i for i in sampled_rows if generators[i] is not None]
    return SamplingBatch(
        temperatures=floats[0],
        greedy=None if ints[1] is None else ints[1].bool(),
        top_k=ints[0],
        top_p=floats[1],
        min_p=floats[2],
        penalties=penalties,
        adjust=(
            build_logit_adjust(adj_rows, static, suppress, vocab_size, device, bitmask, constrained)
            if adj_rows or constrained
            else None
        ),
        generators=generators,
        seeded_rows=seeded_rows,
        vocab_size=vocab_size,
        all_greedy=not sampled_rows,
        any_greedy=len(sampled_rows) < len(states),
        any_unseeded=len(seeded_rows) < len(sampled_rows),
        do_top_k=do_top_k,
        do_top_p=do_top_p,
        do_min_p=do_min_p,
        trunc_rows=upload(trunc, torch.int64, device) if trunc else None,
        max_logprobs=min(max(asked), vocab_size) if asked else None,
    )


def apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Adjusted and penalized float32 copy of `logits` [bs, vocab] (see logit_adjust.py
    and penalties.py for the formulas)."""
    return apply_penalty_tensors(apply_logit_adjust(logits, batch.adjust), batch.penalties)


def _top_k_top_p_drop(
    sub: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, do_top_p: bool
) -> torch.Tensor:
    """Mask [nt, vocab] (vocab order) of what top_k, then top_p, drop from `sub` [nt, vocab]."""
    # NOTE: stable sort makes the kept set among tied logits deterministic per row.
    vals, order = sub.sort(dim=-1, descending=True, stable=True)  # [nt, vocab] each
    ranks = torch.arange(sub.shape[1], device=sub.device)[None, :]  # [1, vocab]
    drop = ranks >= top_k[:, None]  # [nt, vocab], sorted order
    if do_top_p:
        probs = vals.masked_fill(drop, float("-inf")).softmax(dim=-1)  # [nt, vocab]
        before = probs.cumsum(dim=-1) - probs  # mass of strictly more probable tokens
        p = top_p[:, None]  # [nt, 1]
        # NOTE: rows with top_p == 1 drop nothing here (no rounding-driven tail cut).
        drop |= (before >= p - _TOP_P_EPS) & (p < 1.0)
        drop[:, 0] = False  # the most probable token always stays
    return torch.empty_like(drop).scatter_(1, order, drop)


def _truncate(scaled: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask (in place, -inf) what top_k, then top_p, then min_p drop. scaled: [bs, vocab].

    NOTE: a row's mask depends only on that row, so a seeded row samples the same
    token whatever else is in the batch; only rows with top_k/top_p on are sorted.
    """
    neg_inf = float("-inf")
    rows = batch.trunc_rows
    if rows is not None:
        if rows.numel() == scaled.shape[0]:  # every row: skip the gather / scatter
            scaled.masked_fill_(
                _top_k_top_p_drop(scaled, batch.top_k, batch.top_p, batch.do_top_p), neg_inf
            )
        else:
            sub = scaled.index_select(0, rows)  # [nt, vocab]
            drop = _top_k_top_p_drop(sub, batch.top_k[rows], batch.top_p[rows], batch.do_top_p)
            scaled.index_copy_(0, rows, sub.masked_fill_(drop, neg_inf))
    if batch.do_min_p:
        # p < min_p * p_max  <=>  logit < max_logit + log(min_p); log(0) = -inf drops nothing.
        floor = scaled.amax(dim=-1, keepdim=True) + torch.log(batch.min_p)[:, None]  # [bs, 1]
        scaled.masked_fill_(scaled < floor, neg_inf)
    return scaled


def argmax_rows(x: torch.Tensor, kernels: KernelPolicy) -> torch.Tensor:
    """argmax over the last dim of x [bs, vocab] -> [bs] int64 (the Triton kernel on
    CUDA where `kernels` allows it: torch's one-block-per-row reduce idles the GPU at
    small batches)."""
    if kernels.use_fused(x):
        from gyrfalcon.kernels.argmax import argmax_rows as triton_argmax_rows

        return triton_argmax_rows(x, pdl=kernels.pdl)
    return x.argmax(dim=-1)


def row_draws(
    batch: SamplingBatch,
    n: int,
    device: torch.device,
    fill: Callable[..., torch.Tensor] = torch.Tensor.exponential_,
) -> torch.Tensor:
    """[bs, n] float32 random draws: `fill` (an in-place random Tensor method) runs
    first over the whole tensor with the default generator if any sampled row is
    unseeded, then over each seeded sampled row with the row's own generator, in row
    order. Other rows hold 1.0 (or the default draw). No host sync."""
    shape = (batch.batch_size, n)
    if batch.any_unseeded:
        out = fill(torch.empty(shape, dtype=torch.float32, device=device))  # default generator
    else:
        out = torch.ones(shape, dtype=torch.float32, device=device)
    for row in batch.seeded_rows:
        # NOTE: a full row from the request's own generator; no host sync.
        fill(out[row], generator=batch.generators[row])
    return out


def gumbel_argmax(
    scaled: torch.Tensor, batch: SamplingBatch, kernels: KernelPolicy
) -> torch.Tensor:
    """Sample one token per row from softmax(scaled) [bs, vocab] -> [bs] int64; draws
    one Exponential(1) per vocab entry (`row_draws`); modifies `scaled`."""
    noise = row_draws(batch, scaled.shape[1], scaled.device)
    noise.clamp_min_(torch.finfo(torch.float32).tiny).log_()
    return argmax_rows(scaled.sub_(noise), kernels)  # argmax(p / E) == argmax(logit - log E)


def _check_shape(logits: torch.Tensor, batch: SamplingBatch) -> None:
    if tuple(logits.shape) != (batch.batch_size, batch.vocab_size):
        raise ValueError(
            f"logits {tuple(logits.shape)} do not match batch ({batch.batch_size}, "
            f"{batch.vocab_size})"
        )


def _sampling_logits(penalized: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Tempered, truncated copy of penalized logits [bs, vocab] (sampled rows' logits)."""
    assert batch.temperatures is not None
    return _truncate(penalized / batch.temperatures[:, None], batch)  # a new tensor


def sampling_probs(
    logits: torch.Tensor, batch: SamplingBatch, kernels: KernelPolicy = DEFAULT_KERNELS
) -> torch.Tensor:
    """The distribution `sample` draws each row's token from: [bs, vocab] float32.

    Sampled rows: softmax of the adjusted, penalized, tempered, truncated logits
    (zero where truncated). Greedy rows: one-hot at `sample`'s greedy token (the
    lowest id among tied maxima). Consumes no RNG; `logits` is never modified.
    """
    _check_shape(logits, batch)
    penalized = apply_penalties(logits, batch)  # [bs, vocab] float32
    if batch.any_greedy:
        top = argmax_rows(penalized, kernels)[:, None]  # [bs, 1]
        one_hot = torch.zeros_like(penalized).scatter_(1, top, 1.0)
        if batch.all_greedy:
            return one_hot
    probs = _sampling_logits(penalized, batch).softmax(dim=-1)
    if not batch.any_greedy:
        return probs
    assert batch.greedy is not None
    return torch.where(batch.greedy[:, None], one_hot, probs)


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    argmax: torch.Tensor | None = None,
    kernels: KernelPolicy = DEFAULT_KERNELS,
) -> SampleOutput:
    """Pick one token per row of `logits` [bs, vocab] (any float dtype).

    argmax: [bs] argmax of `logits` when already computed (the decode graph does):
    an all-greedy batch without penalties takes it as is.
    kernels: the model's kernel policy (the argmax kernel on CUDA).

    Greedy rows: argmax of the adjusted, penalized logits. Other rows: logit
    adjustments -> penalties -> temperature -> top_k -> top_p -> min_p -> draw.
    Reported logprobs are of the model's raw distribution (log_softmax of the raw
    logits in float32, before penalties and temperature): the chosen token's
    plus the top `batch.max_logprobs` tokens, descending.
    `logits` is never modified. No host sync happens here.
    """
    _check_shape(logits, batch)
    if batch.all_greedy and batch.penalties is None and batch.adjust is None and argmax is not None:
        token_ids = argmax  # NOTE: no float32 copy of the logits on this path
    else:
        penalized = apply_penalties(logits, batch)  # [bs, vocab] float32, a new tensor
        if batch.all_greedy:
            token_ids = argmax_rows(penalized, kernels)
        else:
            assert batch.temperatures is not None and batch.greedy is not None
            token_ids = gumbel_argmax(_sampling_logits(penalized, batch), batch, kernels)
            if batch.any_greedy:
                token_ids = torch.where(batch.greedy, argmax_rows(penalized, kernels), token_ids)
    if batch.max_logprobs is None:
        return SampleOutput(token_ids, None, None, None)
    chosen, top_ids, top_lp = raw_logprobs(logits, token_ids, batch.max_logprobs)
    return SampleOutput(token_ids, chosen, top_ids, top_lp)
