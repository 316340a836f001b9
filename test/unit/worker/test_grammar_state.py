"""Structured output on the worker: the grammar masks the sampler applies, a matcher
that follows a request's output, and verification under a grammar, where a draft the
grammar refuses is rejected even when the unconstrained target would accept it."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.ipc.messages import SamplingParams, StructuredOutput
from gyrfalcon.kernels.dispatch import DEFAULT_KERNELS
from gyrfalcon.worker.grammar_state import (
    WorkerGrammars,
    allocate_bitmask,
    allow_only,
    apply_bitmask,
    fill_masks,
    sync_all,
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
    logits = torch.zeros(1, vocab)
    apply_bitmask(logits, bitmask[row : row + 1], torch.tensor([0]))
    return set((logits[0] == 0).nonzero().flatten().tolist())


def test_masks_apply_to_their_rows_only_and_leave_the_others():
    vocab = 100  # NOTE: not a multiple of 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32)
    logits = torch.randn(3, vocab)
    out = logits.clone()
    apply_bitmask(out, bitmask, torch.tensor([0, 2]))
    assert torch.equal(out[1], logits[1])
    for r in (0, 2):
        bits = [(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
        assert [x == float("-inf") for x in out[r].tolist()] == [b == 0 for b in bits]


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


def test_masks_filled_together_equal_masks_filled_one_by_one(grammars, tokenizer):
    """Distinct states fill in parallel (xgrammar's threads), a state met twice one
    position at a time; either way each row is its state's own mask."""
    schema = StructuredOutput(kind="json_schema", spec='{"type": "object"}')
    texts = ['{"a', '{"a": 1', '{"a": [tru', "{", '{"b": "x\\']
    states = [grammars.state(schema) for _ in texts]
    for state, text in zip(states, texts):
        state.sync(tokenizer.encode(text))
    vocab = grammars.vocab_size
    alone = allocate_bitmask(len(states), vocab)
    for row, state in enumerate(states):
        state.fill(alone, row, [])
    together = allocate_bitmask(len(states), vocab)
    fill_masks(together, [(row, state, []) for row, state in enumerate(states)])
    assert torch.equal(alone, together)
    assert len({tuple(r.tolist()) for r in alone}) == len(texts)  # five different states
    again = allocate_bitmask(2, vocab)  # the same state twice, with and without a prefix
    fill_masks(again, [(0, states[3], []), (1, states[3], tokenizer.encode('"k": 2'))])
    assert torch.equal(again[0], alone[3]) and not torch.equal(again[1], alone[3])


def test_states_synced_together_follow_their_outputs(grammars, tokenizer):
    """One new token each goes through one batched call; more, or none, one by one; a
    token the grammar refuses marks its state broken (and it then allows everything)."""
    schema = StructuredOutput(kind="json_schema", spec='{"type": "object"}')
    outputs = [tokenizer.encode(t) for t in ['{"a": 1', '{"bb": [', "{"]]
    states = [grammars.state(schema) for _ in outputs]
    ref = [grammars.state(schema) for _ in outputs]
    for state, r, out in zip(states, ref, outputs):
        state.sync(out[:-1])
        r.sync(out)
    states[2].consumed = 0  # NOTE: nothing consumed yet: its whole output, one by one
    sync_all([(s, o) for s, o in zip(states, outputs)])
    vocab = grammars.vocab_size
    got, want = allocate_bitmask(3, vocab), allocate_bitmask(3, vocab)
    fill_masks(got, [(i, s, []) for i, s in enumerate(states)])
    fill_masks(want, [(i, s, []) for i, s in enumerate(ref)])
    assert torch.equal(got, want)
    refused = tokenizer.encode("}")  # '{"a": 1' then '}' is fine; '{"bb": [' then '}' is not
    sync_all([(states[1], outputs[1] + refused)])
    assert states[1].broken
    states[1].fill(got, 1, [])
    assert bool((got[1] == -1).all())


def test_a_complete_grammar_ends_the_output_whatever_min_tokens_says(grammars, tokenizer):
    """min_tokens would hold back the stop tokens, the only ones a complete grammar
    allows: the grammar wins, and the row ends on a stop token."""
    params = SamplingParams(temperature=0.0, structured=YES_NO, min_tokens=50)
    state = RequestSamplingState.create(params, [0], CPU, grammars.stop_ids, grammars.state(YES_NO))
    state.output_ids.extend(tokenizer.encode("yes"))
    logits = torch.randn(1, grammars.vocab_size, generator=torch.Generator().manual_seed(1))
    out = sample(logits, prepare([state], grammars.vocab_size, CPU), logits.argmax(-1))
    assert out.token_ids.tolist()[0] in grammars.stop_ids


def test_a_grammar_that_does_not_compile_leaves_its_row_unconstrained(grammars):
    """The frontend builds every spec first; should the worker's compile still fail, the
    request goes on unconstrained (an error is logged) instead of ending the worker."""
    state = grammars.state(StructuredOutput(kind="regex", spec="(unclosed"))
    bitmask = allocate_bitmask(1, grammars.vocab_size)
    bitmask.zero_()
    state.sync([5, 6])
    state.fill(bitmask, 0, [7])
    assert state.broken and state.consumed == 2 and bool((bitmask == -1).all())
