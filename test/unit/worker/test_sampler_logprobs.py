"""Sampler logprobs: raw log_softmax values, top-k ordering, per-row cuts, prompt logprobs."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.ipc.messages import PositionLogprobs, SamplingParams
from gyrfalcon.worker import logprobs as logprobs_module
from gyrfalcon.worker.sampler import (
    RequestSamplingState,
    prepare,
    prompt_logprobs,
    sample,
    to_position_logprobs,
)

CPU = torch.device("cpu")


def test_logprobs_are_raw_log_softmax_with_sorted_top_k():
    logits = torch.randn(3, 32, generator=torch.Generator().manual_seed(0)) * 2
    params = [
        # penalties and temperature must not leak into reported logprobs
        SamplingParams(temperature=0.0, repetition_penalty=3.0, presence_penalty=2.0, logprobs=1),
        SamplingParams(temperature=0.5, top_k=4, seed=1, logprobs=3),
        SamplingParams(temperature=1.0),  # did not ask
    ]
    states = [RequestSamplingState.create(p, [1, 2], CPU) for p in params]
    states[0].output_ids.extend([int(logits[0].argmax())] * 2)
    batch = prepare(states, 32, CPU)
    assert batch.max_logprobs == 3
    out = sample(logits, batch)
    ref = torch.log_softmax(logits.double(), dim=-1).float()
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    chosen_ref = ref.gather(1, out.token_ids[:, None]).squeeze(1)
    torch.testing.assert_close(out.logprobs, chosen_ref)
    assert out.top_ids is not None and out.top_logprobs is not None
    assert out.top_ids.shape == (3, 3) and out.top_ids.dtype == torch.int64
    assert torch.equal(out.top_ids, ref.topk(3, dim=-1).indices)
    torch.testing.assert_close(out.top_logprobs, ref.topk(3, dim=-1).values)
    assert bool((out.top_logprobs[:, :-1] >= out.top_logprobs[:, 1:]).all())
    # the penalty moved the greedy choice away from the raw argmax
    assert int(out.token_ids[0]) != int(logits[0].argmax())


def test_logprobs_of_half_precision_logits_are_float32():
    logits = torch.randn(2, 20, generator=torch.Generator().manual_seed(1)).to(torch.float16)
    states = [
        RequestSamplingState.create(SamplingParams(temperature=0.0, logprobs=0), [0], CPU)
        for _ in range(2)
    ]
    out = sample(logits, prepare(states, 20, CPU))
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    assert out.top_ids is not None and out.top_ids.shape == (2, 0)
    ref = torch.log_softmax(logits.float(), dim=-1).max(dim=-1).values
    torch.testing.assert_close(out.logprobs, ref)


def test_to_position_logprobs_cuts_to_row_k():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [4.0, 0.0, 0.0, 1.0]])
    states = [
        RequestSamplingState.create(SamplingParams(temperature=0.0, logprobs=3), [0], CPU),
        RequestSamplingState.create(SamplingParams(temperature=0.0, logprobs=1), [0], CPU),
    ]
    out = sample(logits, prepare(states, 4, CPU)).cpu()
    lp = torch.log_softmax(logits, dim=-1)
    first = to_position_logprobs(out, 0, 3)
    assert isinstance(first, PositionLogprobs)
    assert first.token_id == 1
    assert first.logprob == pytest.approx(float(lp[0, 1]), abs=1e-6)
    assert [t.token_id for t in first.top] == [1, 3, 2]
    assert [t.logprob for t in first.top] == pytest.approx(lp[0, [1, 3, 2]].tolist(), abs=1e-6)
    second = to_position_logprobs(out, 1, 1)
    assert second.token_id == 0 and [t.token_id for t in second.top] == [0]
    assert to_position_logprobs(out, 1, 0).top == []
    with pytest.raises(ValueError):
        to_position_logprobs(out, 0, 4)


def test_to_position_logprobs_requires_logprobs():
    state = RequestSamplingState.create(SamplingParams(temperature=0.0), [0], CPU)
    out = sample(torch.zeros(1, 4), prepare([state], 4, CPU))
    with pytest.raises(ValueError):
        to_position_logprobs(out, 0, 0)


def test_max_logprobs_is_clamped_to_vocab():
    state = RequestSamplingState.create(SamplingParams(logprobs=50), [0], CPU)
    out = sample(torch.randn(1, 6), prepare([state], 6, CPU))
    assert out.top_ids is not None and sorted(out.top_ids[0].tolist()) == list(range(6))


@pytest.mark.parametrize("chunk_elems", [1 << 24, 24])  # one chunk / three rows per chunk
def test_prompt_logprobs_values(monkeypatch, chunk_elems):
    monkeypatch.setattr(logprobs_module, "_PROMPT_LOGPROBS_CHUNK_ELEMS", chunk_elems)
    logits = torch.randn(7, 8, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    next_ids = torch.tensor([3, 0, 7, 7, 1, 2, 5])
    result = prompt_logprobs(logits, next_ids, 2)
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert len(result) == 7
    for i, pos in enumerate(result):
        assert pos.token_id == int(next_ids[i])
        assert pos.logprob == pytest.approx(float(ref[i, next_ids[i]]), abs=1e-6)
        top = ref[i].topk(2)
        assert [t.token_id for t in pos.top] == top.indices.tolist()
        assert [t.logprob for t in pos.top] == pytest.approx(top.values.tolist(), abs=1e-6)


def test_prompt_logprobs_k_zero_and_shape_check():
    logits = torch.randn(3, 5)
    result = prompt_logprobs(logits, torch.tensor([1, 2, 3]), 0)
    assert [p.top for p in result] == [[], [], []]
    with pytest.raises(ValueError):
        prompt_logprobs(logits, torch.tensor([1, 2]), 1)


def _ranked_reference(row: list[float], k: int) -> list[tuple[float, int]]:
    # (value descending, id ascending): the order greedy decoding's argmax implies
    return sorted(((v, i) for i, v in enumerate(row)), key=lambda t: (-t[0], t[1]))[:k]


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_top_k_orders_equal_logprobs_by_lowest_id(k):
    """16-bit logits often tie at the top; the first entry must be greedy's token (the
    lowest id among equals), and ties at the k-th place must keep the lowest ids."""
    g = torch.Generator().manual_seed(k)
    x = torch.randint(0, 4, (64, 24), generator=g).float()  # many exact ties per row
    x[0] = 7.0  # a whole row of equal values
    vals, ids = logprobs_module.top_k_lowest_ids(x, k)
    assert vals.shape == ids.shape == (64, k) and ids.dtype == torch.int64
    for r in range(64):
        ref = _ranked_reference(x[r].tolist(), k)
        assert ids[r].tolist() == [i for _, i in ref]
        assert vals[r].tolist() == [v for v, _ in ref]
    assert torch.equal(ids[:, 0], x.argmax(dim=-1))


def test_top_k_without_ties_is_topk_and_k0_is_empty():
    x = torch.randn(5, 50, generator=torch.Generator().manual_seed(3))
    vals, ids = logprobs_module.top_k_lowest_ids(x, 6)
    ref = x.topk(6, dim=-1)
    assert torch.equal(ids, ref.indices) and torch.equal(vals, ref.values)
    vals, ids = logprobs_module.top_k_lowest_ids(x, 0)
    assert vals.shape == ids.shape == (5, 0)


def test_prompt_and_sample_logprobs_top_entry_is_the_greedy_token_on_ties():
    """A tie at the top (bf16 logits): greedy picks the lower id, and the top logprob
    reported for that position (sampled and prompt logprobs) names the same token."""
    logits = torch.full((2, 16), -2.0, dtype=torch.bfloat16)
    logits[:, 9] = 3.0
    logits[:, 4] = 3.0  # equal to id 9: greedy takes 4
    logits[1, 12] = 3.0
    states = [
        RequestSamplingState.create(SamplingParams(temperature=0.0, logprobs=2), [0], CPU)
        for _ in range(2)
    ]
    out = sample(logits, prepare(states, 16, CPU))
    assert out.token_ids.tolist() == [4, 4]
    assert out.top_ids is not None and out.top_ids.tolist() == [[4, 9], [4, 9]]
    plp = prompt_logprobs(logits, torch.tensor([9, 12]), k=3)
    assert [[t.token_id for t in p.top] for p in plp] == [[4, 9, 0], [4, 9, 12]]


def test_logprobs_of_many_rows_come_a_few_rows_at_a_time_with_the_same_values(monkeypatch):
    """Sampled logprobs of many rows are scored a few rows at a time (a float32 copy of
    every row's logits at once is rows x vocab floats): the same values and order."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(11, 40, generator=gen) * 3
    ids = torch.randint(0, 40, (11,), generator=gen)
    whole = logprobs_module.raw_logprobs(logits, ids, 4)
    monkeypatch.setattr(logprobs_module, "_PROMPT_LOGPROBS_CHUNK_ELEMS", 3 * 40)  # 3 rows
    chunked = logprobs_module.raw_logprobs(logits, ids, 4)
    for a, b in zip(chunked, whole):
        assert torch.equal(a, b)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(chunked[0], ref.gather(1, ids[:, None]).squeeze(1))
