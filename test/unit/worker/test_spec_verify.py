"""Verify sampling of large steps: the target's sampling probabilities are made a chunk
of logit rows at a time, each chunk with its rows' own sampling; every row's
probabilities equal those of the whole batch at once, whatever it mixes (greedy rows,
temperature, top-k, top-p, min-p, penalties)."""

import torch

from gyrfalcon.ipc.messages import SamplingParams
from gyrfalcon.kernels.dispatch import DEFAULT_KERNELS
from gyrfalcon.worker import spec_verify
from gyrfalcon.worker.sampler import RequestSamplingState, prepare, sampling_probs

CPU = torch.device("cpu")


def test_probabilities_made_in_chunks_equal_the_whole_batchs(monkeypatch):
    vocab, k1 = 50, 4
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=5),
        SamplingParams(temperature=1.2, top_p=0.8, min_p=0.05),
        SamplingParams(temperature=0.9, repetition_penalty=1.3, frequency_penalty=0.4),
        SamplingParams(temperature=1.0, top_k=10, top_p=0.5, seed=7),
    ]
    states = [RequestSamplingState.create(p, [3, 4, 5, 9], CPU) for p in params]
    states[3].output_ids.extend([4, 4, 11])
    expanded = [st for st in states for _ in range(k1)]  # a verify step's positions
    generated = [len(st.output_ids) + m for st in states for m in range(k1)]
    logits = torch.randn(len(expanded), vocab, generator=torch.Generator().manual_seed(0)) * 2
    batch = prepare(expanded, vocab, CPU, generated)
    whole = sampling_probs(logits, batch, DEFAULT_KERNELS)
    monkeypatch.setattr(spec_verify, "PROBS_CHUNK_ELEMS", 3 * vocab)  # 3 rows a chunk
    chunked = spec_verify.probs_in_chunks(logits, expanded, generated, None, DEFAULT_KERNELS)
    assert chunked.shape == whole.shape and chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-6)
    assert (chunked[:k1].sum(-1) == 1).all() and (chunked[:k1] > 0).sum(-1).eq(1).all()  # greedy
