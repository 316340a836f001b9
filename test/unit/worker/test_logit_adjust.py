"""logit_bias, allowed_token_ids and min_tokens in the sampler: what is drawn changes,
what is reported (raw logprobs) does not."""

from __future__ import annotations

import torch

from gyrfalcon.ipc.messages import SamplingParams
from gyrfalcon.worker.sampler import RequestSamplingState, prepare, sample

CPU = torch.device("cpu")
VOCAB = 32
EOS = 2


def states_for(params: list[SamplingParams]) -> list[RequestSamplingState]:
    return [RequestSamplingState.create(p, [0], CPU, (EOS,)) for p in params]


def logits_peaked_at(token: int, rows: int = 1) -> torch.Tensor:
    x = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(token))
    x[:, token] = 10.0
    return x


def test_logit_bias_moves_the_greedy_pick_and_leaves_logprobs_raw():
    logits = logits_peaked_at(5)
    params = SamplingParams(temperature=0.0, logit_bias={7: 100.0}, logprobs=2)
    states = states_for([params])
    batch = prepare(states, VOCAB, CPU)
    argmax = logits.argmax(-1)  # what a decode graph hands over: must not be taken
    out = sample(logits, batch, argmax)
    assert out.token_ids.tolist() == [7]
    raw = torch.log_softmax(logits, -1)
    assert torch.allclose(out.logprobs, raw[:, 7])  # the raw distribution, not the biased one
    assert out.top_ids[0, 0].item() == 5


def test_negative_bias_bans_a_token_in_sampling():
    logits = logits_peaked_at(5, rows=64)
    params = SamplingParams(temperature=1.0, logit_bias={5: -100.0}, seed=3)
    out = sample(logits, prepare(states_for([params] * 64), VOCAB, CPU))
    assert 5 not in out.token_ids.tolist()


def test_allowed_token_ids_restrict_greedy_and_sampled_rows():
    logits = logits_peaked_at(5, rows=3)
    allowed = [9, 11, 30]
    params = [
        SamplingParams(temperature=0.0, allowed_token_ids=allowed),
        SamplingParams(temperature=1.0, allowed_token_ids=allowed, seed=1),
        SamplingParams(temperature=0.0),  # untouched row in the same batch
    ]
    out = sample(logits, prepare(states_for(params), VOCAB, CPU))
    ids = out.token_ids.tolist()
    best_allowed = allowed[int(logits[0, allowed].argmax())]
    assert ids[0] == best_allowed
    assert ids[1] in allowed
    assert ids[2] == 5


def test_sampled_row_draws_only_allowed_tokens():
    logits = torch.zeros(256, VOCAB)
    params = SamplingParams(temperature=1.0, allowed_token_ids=[3, 4])
    out = sample(logits, prepare(states_for([params] * 256), VOCAB, CPU))
    drawn = set(out.token_ids.tolist())
    assert drawn == {3, 4}  # both, and nothing else (256 fair draws of two tokens)


def test_min_tokens_holds_back_eos_and_stop_ids_until_reached():
    logits = logits_peaked_at(EOS)
    logits[0, 6] = 9.0  # a stop_token_id, second best
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6])
    states = states_for([params])
    for generated, expected_is_stop in [(0, False), (2, False), (3, True)]:
        out = sample(logits, prepare(states, VOCAB, CPU, num_generated=[generated]))
        token = out.token_ids.item()
        assert (token in (EOS, 6)) is expected_is_stop, (generated, token)
    # ignore_eos: only the stop ids are held back (EOS is an ordinary token then)
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[6], ignore_eos=True)
    out = sample(logits, prepare(states_for([params]), VOCAB, CPU, num_generated=[0]))
    assert out.token_ids.item() == EOS


def test_min_tokens_defaults_to_the_requests_known_outputs():
    logits = logits_peaked_at(EOS)
    state = states_for([SamplingParams(temperature=0.0, min_tokens=1)])[0]
    assert sample(logits, prepare([state], VOCAB, CPU)).token_ids.item() != EOS
    state.output_ids.append(4)
    assert sample(logits, prepare([state], VOCAB, CPU)).token_ids.item() == EOS


def test_rows_without_adjustments_build_nothing():
    batch = prepare(states_for([SamplingParams(temperature=0.0)] * 2), VOCAB, CPU)
    assert batch.adjust is None
    # min_tokens already reached and no bias: nothing to add this step either
    reached = states_for([SamplingParams(temperature=0.0, min_tokens=1)])
    assert prepare(reached, VOCAB, CPU, num_generated=[1]).adjust is None


def test_ids_outside_the_model_vocabulary_are_ignored():
    logits = logits_peaked_at(5)
    params = SamplingParams(
        temperature=0.0, logit_bias={VOCAB + 3: 100.0}, allowed_token_ids=[5, VOCAB + 1]
    )
    out = sample(logits, prepare(states_for([params]), VOCAB, CPU))
    assert out.token_ids.tolist() == [5]
