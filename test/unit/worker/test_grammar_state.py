"""Structured output on the worker: the grammar masks the sampler applies, a matcher
that follows a request's output, and verification under a grammar, where a draft the
grammar refuses is rejected even when the unconstrained target would accept it."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.ipc.messages import SamplingParams, StructuredOutput
from gyrfalcon.kernels.dispatch import DEFAULT_KERNELS
from gyrfalcon.worker.grammar_state import (
    WorkerGrammars,
    allocate_bitmask,
    allow_only,
    allowed_tokens,
)
from gyrfalcon.worker.sampler import RequestSamplingState, prepare, sample
from gyrfalcon.worker.spec_verify import VerifyIndex, emitted_index, padded_index, verify_sample

CPU = torch.device("cpu")
YES_NO = StructuredOutput(kind="ebnf", spec='root ::= "yes" | "no"')


@pytest.fixture(scope="module")
def grammars(smollm2_dir) -> WorkerGrammars:
    cfg = ModelConfig.from_dir(smollm2_dir)
    return WorkerGrammars(smollm2_dir, cfg.vocab_size, cfg.eos_token_ids)


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def allowed_ids(bitmask: torch.Tensor, row: int, vocab: int) -> set[int]:
    return set(allowed_tokens(bitmask[row : row + 1], vocab)[0].nonzero().flatten().tolist())


def test_unpacked_bitmask_matches_xgrammars_own_masking():
    vocab = 100  # NOTE: not a multiple of 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32)
    logits = torch.zeros(3, vocab)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab)
    assert torch.equal(allowed_tokens(bitmask, vocab), logits == 0)


def test_allow_only_sets_exactly_the_given_tokens_the_sign_bit_included():
    bitmask = allocate_bitmask(2, 100)
    allow_only(bitmask, 1, (0, 31, 63, 99))
    assert allowed_ids(bitmask, 1, 100) == {0, 31, 63, 99}
    assert allowed_ids(bitmask, 0, 100) == set(range(100))  # untouched: every token


def test_matcher_follows_the_output_and_masks_end_in_the_stop_tokens(grammars, tokenizer):
    state = grammars.state(YES_NO)
    vocab, stop = grammars.vocab_size, set(grammars.stop_ids)
    bitmask = allocate_bitmask(3, vocab)
    state.fill(bitmask, 0, [])
    first = allowed_ids(bitmask, 0, vocab)
    texts = {tokenizer.decode([t]) for t in first}
    assert texts and all("yes".startswith(t) or "no".startswith(t) for t in texts), texts
    yes = tokenizer.encode("yes")
    state.fill(bitmask, 1, yes)  # after "yes": only the end
    assert allowed_ids(bitmask, 1, vocab) == stop
    state.fill(bitmask, 2, [])  # fill rolled its prefix back: the start again
    assert allowed_ids(bitmask, 2, vocab) == first
    state.sync(yes)  # the request emitted "yes"
    state.fill(bitmask, 0, [])
    assert allowed_ids(bitmask, 0, vocab) == stop
    state.sync(yes + [grammars.stop_ids[0]])  # ... then its stop token (ignoring EOS)
    state.fill(bitmask, 0, [])
    assert allowed_ids(bitmask, 0, vocab) == stop and not state.broken


def test_a_refused_prefix_token_ends_the_walk_there(grammars, tokenizer):
    state = grammars.state(YES_NO)
    vocab = grammars.vocab_size
    bitmask = allocate_bitmask(2, vocab)
    refused = tokenizer.encode("maybe")[0]
    state.fill(bitmask, 0, [])
    state.fill(bitmask, 1, [refused, *tokenizer.encode("yes")])
    assert torch.equal(bitmask[0], bitmask[1])


def test_greedy_and_sampled_rows_draw_only_what_the_grammar_allows(grammars, tokenizer):
    vocab = grammars.vocab_size
    no, yes = tokenizer.encode("no")[0], tokenizer.encode("yes")[0]
    logits = torch.randn(8, vocab, generator=torch.Generator().manual_seed(0))
    logits[:, no] = 30.0  # what the unconstrained model prefers
    params = [
        SamplingParams(temperature=t, structured=YES_NO, seed=i)
        for i, t in enumerate([0.0] * 4 + [1.5] * 4)
    ]
    params[3] = SamplingParams(temperature=0.0)  # a free row beside them: unchanged
    states = [
        RequestSamplingState.create(p, [0], CPU, grammars.stop_ids, grammars.state(YES_NO))
        if p.structured
        else RequestSamplingState.create(p, [0], CPU)
        for p in params
    ]
    out = sample(logits, prepare(states, vocab, CPU), logits.argmax(-1)).token_ids.tolist()
    assert out[3] == logits[3].argmax().item()
    bitmask = allocate_bitmask(1, vocab)
    grammars.state(YES_NO).fill(bitmask, 0, [])
    allowed = allowed_ids(bitmask, 0, vocab)
    assert no in allowed and yes in allowed
    assert all(t in allowed for i, t in enumerate(out) if i != 3), out


def verify_index(num_drafts: list[int], width: int) -> VerifyIndex:
    def t(x):
        return torch.tensor(x, dtype=torch.int64)

    padded, emitted = padded_index(num_drafts, width), emitted_index(num_drafts, width)
    return VerifyIndex(num_drafts, width, t(padded), t(emitted), t(num_drafts))


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_draft_the_grammar_refuses_is_rejected_though_the_target_prefers_it(
    grammars, tokenizer, temperature
):
    """Row 0 under the grammar, row 1 the same request without it. Position 0's logits
    put 'maybe' far ahead of 'yes' and the drafter proposes 'maybe': the free row
    accepts it, the constrained row must reject it and emit an allowed token."""
    vocab = grammars.vocab_size
    maybe, yes = tokenizer.encode("maybe")[0], tokenizer.encode("yes")[0]
    logits = torch.full((4, vocab), -10.0)  # 2 rows x (1 draft + 1)
    logits[[0, 2], maybe] = 40.0
    logits[[0, 2], yes] = 20.0
    logits[[1, 3], grammars.stop_ids[0]] = 40.0
    constrained = SamplingParams(temperature=temperature, structured=YES_NO, seed=1)
    free = SamplingParams(temperature=temperature, seed=1)
    states = [
        RequestSamplingState.create(
            constrained, [0], CPU, grammars.stop_ids, grammars.state(YES_NO)
        ),
        RequestSamplingState.create(free, [0], CPU, grammars.stop_ids),
    ]
    drafts = torch.tensor([[maybe], [maybe]])
    acc, _ = verify_sample(
        logits, None, states, [0, 0], drafts, verify_index([1, 1], 2), vocab, DEFAULT_KERNELS
    )
    assert acc.accept_len.tolist() == [0, 1]
    emitted = acc.token_ids.tolist()
    assert tokenizer.decode([emitted[0][0]]) in ("yes", "y", "ye", "n", "no")
    assert emitted[1][0] == maybe
