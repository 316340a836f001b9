"""Sampler behaviour: greedy, seeded reproducibility, truncation masks, distribution."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.ipc.messages import SamplingParams
from gyrfalcon.worker.sampler import (
    RequestSamplingState,
    SamplingBatch,
    prepare,
    sample,
)

CPU = torch.device("cpu")


def make_states(params: list[SamplingParams], prompt: list[int] | None = None):
    return [RequestSamplingState.create(p, prompt or [0], CPU) for p in params]


def draw(logits: torch.Tensor, states: list[RequestSamplingState]) -> list[int]:
    batch = prepare(states, logits.shape[1], CPU)
    return sample(logits, batch).token_ids.tolist()


def draw_many(row_logits: torch.Tensor, params: SamplingParams, n: int, seed: int) -> torch.Tensor:
    """n unseeded draws from one distribution, as one batch under a fixed default seed."""
    logits = row_logits.expand(n, -1).contiguous()
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        batch = prepare(make_states([params] * n), logits.shape[1], CPU)
        return sample(logits, batch).token_ids


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    return float(((observed - expected) ** 2 / expected).sum())


def test_greedy_is_argmax_and_consumes_no_rng():
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=1),
        SamplingParams(temperature=0.0, seed=7),
        SamplingParams(temperature=1e-7),  # below the greedy threshold
        SamplingParams(temperature=0.0, top_p=0.5, min_p=0.2),
    ]
    states = make_states(params)
    gen_before = states[2].generator.get_state().clone()
    rng_before = torch.get_rng_state().clone()
    batch = prepare(states, 64, CPU)
    assert batch.all_greedy
    out = sample(logits, batch)
    assert out.token_ids.dtype == torch.int64
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert torch.equal(states[2].generator.get_state(), gen_before)
    assert out.logprobs is None and out.top_ids is None and out.top_logprobs is None


def test_sample_accepts_half_precision_and_leaves_logits_untouched():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    copy = logits.clone()
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=0.5),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(temperature=0.8, top_k=5, min_p=0.1),
    ]
    states = make_states(params, prompt=[1, 2, 3])
    states[0].output_ids.extend([4, 4])
    out = sample(logits, prepare(states, 40, CPU))
    assert torch.equal(logits, copy)
    assert out.token_ids.shape == (3,)
    assert all(0 <= t < 40 for t in out.token_ids.tolist())


def test_seeded_sequence_is_reproducible_and_seed_dependent():
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(2)) * 0.1

    def sequence(seed: int) -> list[int]:
        state = RequestSamplingState.create(SamplingParams(temperature=1.0, seed=seed), [0], CPU)
        return [draw(logits, [state])[0] for _ in range(20)]

    first = sequence(1234)
    assert sequence(1234) == first
    assert len(set(first)) > 1  # the generator advances between draws
    assert sequence(4321) != first


def test_seeded_row_is_independent_of_batch_composition_and_position():
    logits_row = torch.randn(1, 200, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=0.9, seed=99)
    others = [
        SamplingParams(temperature=1.0),  # unseeded: default RNG
        SamplingParams(temperature=0.7, top_p=0.8, top_k=20, min_p=0.05, seed=5),
        SamplingParams(temperature=0.0),  # greedy
    ]
    other_logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(4))

    def run(layout: str) -> list[int]:
        state = RequestSamplingState.create(seeded, [0], CPU)
        rest = make_states(others)
        tokens = []
        for _ in range(10):
            if layout == "alone":
                tokens.append(draw(logits_row, [state])[0])
            elif layout == "first":
                tokens.append(draw(torch.cat([logits_row, other_logits]), [state, *rest])[0])
            else:
                mixed = torch.cat([other_logits[:2], logits_row, other_logits[2:]])
                tokens.append(draw(mixed, [rest[0], rest[1], state, rest[2]])[2])
        return tokens

    alone = run("alone")
    assert len(set(alone)) > 1
    assert run("first") == alone
    assert run("middle") == alone


def test_seeded_truncated_row_is_independent_of_batch_composition():
    # alone, the row is sorted as the whole batch; batched, as a gathered subset
    logits_row = torch.randn(1, 300, generator=torch.Generator().manual_seed(8))
    seeded = SamplingParams(temperature=1.2, top_k=40, top_p=0.8, min_p=0.02, seed=17)
    others = make_states([SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)])
    other_logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(9))
    alone_state = RequestSamplingState.create(seeded, [0], CPU)
    batched_state = RequestSamplingState.create(seeded, [0], CPU)
    for _ in range(15):
        alone = draw(logits_row, [alone_state])[0]
        batch = prepare([others[0], batched_state, others[1]], 300, CPU)
        assert batch.trunc_rows is not None and batch.trunc_rows.tolist() == [1]
        mixed = torch.cat([other_logits[:1], logits_row, other_logits[1:]])
        assert sample(mixed, batch).token_ids[1].item() == alone


def test_per_row_truncation_in_a_mixed_batch():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(3000, -1).contiguous()
    params = [SamplingParams(top_p=0.7), SamplingParams(), SamplingParams(top_k=3)]
    states = make_states([params[i % 3] for i in range(3000)])
    with torch.random.fork_rng():
        torch.manual_seed(10)
        batch = prepare(states, 4, CPU)
        assert batch.trunc_rows is not None and batch.trunc_rows.numel() == 2000
        tokens = sample(logits, batch).token_ids
    assert set(tokens[0::3].tolist()) == {0, 1}
    assert set(tokens[1::3].tolist()) == {0, 1, 2, 3}
    assert set(tokens[2::3].tolist()) == {0, 1, 2}


def test_top_k_never_samples_outside_the_k_largest():
    logits = torch.randn(1, 30, generator=torch.Generator().manual_seed(5))
    allowed = set(logits[0].topk(3).indices.tolist())
    tokens = draw_many(logits, SamplingParams(temperature=1.5, top_k=3), 3000, seed=0)
    assert set(tokens.tolist()) == allowed


def test_top_k_with_ties_keeps_exactly_k_tokens():
    tokens = draw_many(torch.zeros(1, 10), SamplingParams(top_k=4), 3000, seed=1)
    assert len(set(tokens.tolist())) == 4


@pytest.mark.parametrize(
    ("probs", "top_p", "expected"),
    [
        ([0.5, 0.3, 0.15, 0.05], 0.7, {0, 1}),
        ([0.5, 0.3, 0.15, 0.05], 0.5, {0}),
        ([0.5, 0.3, 0.15, 0.05], 0.81, {0, 1, 2}),
        ([0.15, 0.5, 0.05, 0.3], 0.7, {1, 3}),  # unsorted vocab order
        ([0.05, 0.9, 0.05], 1e-9, {1}),  # the top token always stays
    ],
)
def test_top_p_keeps_smallest_set_reaching_top_p(probs, top_p, expected):
    logits = torch.tensor([probs]).log()
    tokens = draw_many(logits, SamplingParams(top_p=top_p), 4000, seed=2)
    assert set(tokens.tolist()) == expected


def test_top_p_renormalizes_after_top_k():
    # top_k=2 leaves [0.4, 0.35] -> renormalized [0.533, 0.467]; top_p=0.5 keeps only token 0.
    logits = torch.tensor([[0.4, 0.35, 0.25]]).log()
    tokens = draw_many(logits, SamplingParams(top_k=2, top_p=0.5), 2000, seed=3)
    assert set(tokens.tolist()) == {0}


def test_min_p_is_relative_to_max_probability_after_temperature():
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    # T=1: ratios to max [1, .75, .5, .25] -> min_p=0.3 keeps {0, 1, 2}
    plain = draw_many(logits, SamplingParams(min_p=0.3), 4000, seed=4)
    assert set(plain.tolist()) == {0, 1, 2}
    # T=0.5: probs ~ p^2, ratios [1, .5625, .25, .0625] -> keeps {0, 1}
    tempered = draw_many(logits, SamplingParams(temperature=0.5, min_p=0.3), 4000, seed=4)
    assert set(tempered.tolist()) == {0, 1}


def test_small_temperature_sampling_matches_argmax():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(6)) * 3
    logits[0, 17] = logits.max() + 1.0
    tokens = draw_many(logits, SamplingParams(temperature=1e-3), 2000, seed=5)
    assert set(tokens.tolist()) == {17}
    warm = draw_many(logits, SamplingParams(temperature=1.0), 2000, seed=5)
    assert len(set(warm.tolist())) > 1


# chi-square critical value, 5 degrees of freedom, p = 0.001
CHI2_DF5_P001 = 20.515


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_empirical_frequencies_match_softmax(temperature):
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 0.2]])
    probs = torch.softmax(logits[0] / temperature, dim=-1)
    tokens = draw_many(logits, SamplingParams(temperature=temperature), 20000, seed=7)
    assert chi_square(tokens, probs) < CHI2_DF5_P001
    # the sampler's distribution is not the untempered one
    if temperature != 1.0:
        assert chi_square(tokens, torch.softmax(logits[0], dim=-1)) > 10 * CHI2_DF5_P001


def test_seeded_draws_follow_softmax():
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5, 2.0, 0.2]])
    state = RequestSamplingState.create(SamplingParams(seed=11), [0], CPU)
    batch = prepare([state], 6, CPU)
    tokens = torch.tensor([sample(logits, batch).token_ids.item() for _ in range(3000)])
    assert chi_square(tokens, torch.softmax(logits[0], dim=-1)) < CHI2_DF5_P001


def test_mixed_batch_of_greedy_and_sampled_rows():
    logits = torch.zeros(4, 16)
    logits[0, 3] = 0.5  # greedy row: argmax 3 despite a flat-ish distribution
    logits[2, 9] = 0.1
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, seed=1),
        SamplingParams(temperature=1.0, seed=2),
    ]
    states = make_states(params)
    greedy_gen = states[2].generator.get_state().clone()
    batch = prepare(states, 16, CPU)
    assert not batch.all_greedy and batch.any_greedy and batch.seeded_rows == [3]
    rows = [sample(logits, batch).token_ids.tolist() for _ in range(50)]
    assert torch.equal(states[2].generator.get_state(), greedy_gen)  # greedy: no RNG used
    assert {r[0] for r in rows} == {3}
    assert {r[2] for r in rows} == {9}
    assert len({r[1] for r in rows}) > 5
    assert len({r[3] for r in rows}) > 5


def test_prepare_flags_and_defaults():
    states = make_states(
        [SamplingParams(top_k=100, logprobs=2), SamplingParams(temperature=0.0, top_p=0.5)]
    )
    batch: SamplingBatch = prepare(states, 50, CPU)
    # top_k >= vocab is off; greedy rows do not turn truncation on
    assert not batch.do_top_k and not batch.do_top_p and not batch.do_min_p
    assert batch.top_k.tolist() == [50, 50]
    assert batch.temperatures.tolist() == [1.0, 1.0]
    assert batch.greedy.tolist() == [False, True]
    assert batch.penalties is None and batch.trunc_rows is None
    assert batch.max_logprobs == 2
    assert batch.any_unseeded and batch.seeded_rows == []


def test_precomputed_argmax_serves_only_plain_greedy_batches():
    """The decode graph hands over argmax(logits): an all-greedy batch without
    penalties takes it (no device upload for the batch either); penalties or a
    sampled row make the sampler compute its own."""
    logits = torch.tensor([[5.0, 4.0, 0.0], [0.0, 1.0, 9.0]])
    graph_ids = torch.tensor([0, 2])
    greedy = make_states([SamplingParams(temperature=0.0)] * 2)
    batch = prepare(greedy, 3, CPU)
    assert batch.temperatures is None and batch.greedy is None  # nothing uploaded
    assert sample(logits, batch, graph_ids).token_ids is graph_ids
    penalized = make_states([SamplingParams(temperature=0.0, presence_penalty=5.0)] * 2)
    for s in penalized:
        s.output_ids.append(0)
    got = sample(logits, prepare(penalized, 3, CPU), graph_ids).token_ids
    assert got.tolist() == [1, 2]  # the penalty moved row 0 off the graph's argmax
    mixed = make_states([SamplingParams(temperature=0.0), SamplingParams(temperature=1e-4)])
    assert sample(logits, prepare(mixed, 3, CPU), graph_ids).token_ids.tolist() == [0, 2]


def test_sample_rejects_mismatched_logits():
    batch = prepare(make_states([SamplingParams()]), 10, CPU)
    with pytest.raises(ValueError):
        sample(torch.zeros(1, 11), batch)
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 10), batch)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=-0.1),
        SamplingParams(top_p=0.0),
        SamplingParams(top_p=1.5),
        SamplingParams(top_k=-2),
        SamplingParams(min_p=1.5),
        SamplingParams(repetition_penalty=0.0),
        SamplingParams(logprobs=-1),
    ],
)
def test_create_rejects_invalid_params(params):
    with pytest.raises(ValueError):
        RequestSamplingState.create(params, [0], CPU)


def test_create_seeds_generator_only_with_seed():
    assert RequestSamplingState.create(SamplingParams(), [1], CPU).generator is None
    a = RequestSamplingState.create(SamplingParams(seed=-3), [1], CPU).generator
    b = RequestSamplingState.create(SamplingParams(seed=-3), [1], CPU).generator
    assert a is not None and b is not None
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))
    c = RequestSamplingState.create(SamplingParams(seed=2**70 + 5), [1], CPU).generator
    assert c is not None and not torch.equal(torch.rand(4, generator=c), torch.rand(4, generator=b))
