"""Repetition / presence / frequency penalties: exact formulas, batching, device mirroring."""

from __future__ import annotations

import random

import pytest
import torch

from gyrfalcon.ipc.messages import SamplingParams
from gyrfalcon.worker.penalties import DeviceTokenBuffer
from gyrfalcon.worker.sampler import RequestSamplingState, apply_penalties, prepare, sample

CPU = torch.device("cpu")


def penalize(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    state = RequestSamplingState.create(params, prompt, CPU)
    state.output_ids.extend(output)
    return apply_penalties(logits, prepare([state], logits.shape[1], CPU))


def reference(logits: torch.Tensor, params: SamplingParams, prompt, output) -> torch.Tensor:
    """Scalar loop over the formulas, independent of the implementation."""
    out = logits.double().clone()
    for tok in range(out.shape[1]):
        x = float(out[0, tok])
        if tok in prompt or tok in output:
            x = x / params.repetition_penalty if x > 0 else x * params.repetition_penalty
        count = output.count(tok)
        x -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
        out[0, tok] = x
    return out.float()


LOGITS = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])


def test_repetition_penalty_divides_positive_and_multiplies_negative():
    got = penalize(LOGITS, SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[3])
    expected = torch.tensor([[1.0, -2.0, 0.5, -6.0, 1.0, 0.0]])
    assert torch.equal(got, expected)


def test_presence_penalty_counts_output_once_and_ignores_prompt():
    got = penalize(LOGITS, SamplingParams(presence_penalty=0.5), prompt=[0], output=[2, 2, 2, 4])
    expected = torch.tensor([[2.0, -1.0, 0.0, -3.0, 0.5, 0.0]])
    assert torch.equal(got, expected)


def test_frequency_penalty_scales_with_output_count():
    got = penalize(LOGITS, SamplingParams(frequency_penalty=0.25), prompt=[5], output=[2, 2, 2, 4])
    expected = torch.tensor([[2.0, -1.0, -0.25, -3.0, 0.75, 0.0]])
    assert torch.equal(got, expected)


def test_all_penalties_combined_match_reference():
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=-0.2)
    prompt, output = [1, 4], [0, 0, 3, 4, 4, 4]
    got = penalize(LOGITS, params, prompt, output)
    torch.testing.assert_close(got, reference(LOGITS, params, prompt, output))


def test_random_batch_matches_reference_and_spares_unpenalized_rows():
    rng = random.Random(0)
    vocab = 40
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0)) * 3
    params = [
        SamplingParams(repetition_penalty=1.7, frequency_penalty=0.3),
        SamplingParams(),  # no penalty
        SamplingParams(presence_penalty=0.9, temperature=0.0),
        SamplingParams(),  # no penalty
        SamplingParams(repetition_penalty=0.8, presence_penalty=-0.5, frequency_penalty=1.1),
    ]
    states = []
    for p in params:
        state = RequestSamplingState.create(p, [rng.randrange(vocab) for _ in range(15)], CPU)
        state.output_ids.extend(rng.randrange(vocab) for _ in range(25))
        states.append(state)
    batch = prepare(states, vocab, CPU)
    assert batch.penalties is not None and batch.penalties.rows.tolist() == [0, 2, 4]
    got = apply_penalties(logits, batch)
    for i, (p, s) in enumerate(zip(params, states)):
        ref = reference(logits[i : i + 1], p, s.prompt_ids, s.output_ids)
        torch.testing.assert_close(got[i : i + 1], ref)
    assert torch.equal(got[1], logits[1]) and torch.equal(got[3], logits[3])


def test_no_penalties_means_no_penalty_tensors():
    states = [RequestSamplingState.create(SamplingParams(), [1, 2], CPU)]
    batch = prepare(states, 8, CPU)
    assert batch.penalties is None
    logits = torch.randn(1, 8)
    assert torch.equal(apply_penalties(logits, batch), logits)


def test_large_penalty_flips_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]])
    for params in (
        SamplingParams(temperature=0.0, frequency_penalty=0.6),
        SamplingParams(temperature=0.0, presence_penalty=1.5),
        SamplingParams(temperature=0.0, repetition_penalty=1.5),
    ):
        plain = RequestSamplingState.create(SamplingParams(temperature=0.0), [2], CPU)
        plain.output_ids.extend([0, 0])
        penalized = RequestSamplingState.create(params, [2], CPU)
        penalized.output_ids.extend([0, 0])
        assert sample(logits, prepare([plain], 4, CPU)).token_ids.tolist() == [0]
        assert sample(logits, prepare([penalized], 4, CPU)).token_ids.tolist() == [1]


def test_prompt_tokens_only_trigger_repetition_penalty():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    rep = RequestSamplingState.create(
        SamplingParams(temperature=0, repetition_penalty=2.0), [0], CPU
    )
    pres = RequestSamplingState.create(
        SamplingParams(temperature=0, presence_penalty=5.0), [0], CPU
    )
    assert sample(logits, prepare([rep], 3, CPU)).token_ids.tolist() == [1]
    assert sample(logits, prepare([pres], 3, CPU)).token_ids.tolist() == [0]


def test_counts_follow_appended_outputs_across_steps():
    params = SamplingParams(frequency_penalty=1.0, repetition_penalty=2.0)
    state = RequestSamplingState.create(params, [3], CPU)
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    expected = [1.0, 1.0, 1.0, 0.5, 1.0]
    for tok in [0, 2, 2, 4, 0, 2]:
        state.output_ids.append(tok)
        count = state.output_ids.count(tok)
        expected[tok] = 0.5 - count  # repetition then frequency
        got = apply_penalties(logits, prepare([state], 5, CPU))
        assert got[0].tolist() == expected


def test_device_token_buffer_mirrors_appends_and_truncation():
    buf = DeviceTokenBuffer()
    ids: list[int] = []
    assert buf.sync(ids, 100, CPU).tolist() == []
    for step in range(70):  # crosses the initial capacity
        ids.append((step * 7) % 100)
        assert buf.sync(ids, 100, CPU).tolist() == ids
    del ids[10:]
    assert buf.sync(ids, 100, CPU).tolist() == ids
    ids.extend([5, 6])
    assert buf.sync(ids, 100, CPU).tolist() == ids
    ids[0] = 99  # an in-place edit needs invalidate()
    buf.invalidate()
    assert buf.sync(ids, 100, CPU).tolist() == ids


def test_out_of_vocab_token_is_rejected():
    state = RequestSamplingState.create(SamplingParams(presence_penalty=1.0), [1], CPU)
    state.output_ids.append(10)
    with pytest.raises(ValueError):
        prepare([state], 10, CPU)
