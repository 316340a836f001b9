"""A request's sampling state: the flags the sampler reads per row, derived once."""

import pytest
import torch

from gyrfalcon.ipc.messages import SamplingParams
from gyrfalcon.worker.sampling_state import RequestSamplingState, is_greedy


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=1),
        SamplingParams(temperature=0.7, top_p=0.9),
        SamplingParams(temperature=0.0, repetition_penalty=1.1),
        SamplingParams(temperature=1.0, presence_penalty=0.5),
        SamplingParams(temperature=0.0, frequency_penalty=-0.2),
    ],
)
def test_derived_flags_follow_the_params(params):
    state = RequestSamplingState.create(params, [1, 2], torch.device("cpu"))
    penalty = (
        params.repetition_penalty != 1.0
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
    )
    assert state.greedy == is_greedy(params)
    assert state.has_penalty == penalty and state.reads_outputs == penalty
