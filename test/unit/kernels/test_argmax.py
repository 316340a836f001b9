"""Triton row argmax (CPU interpreter) against torch.argmax, ties and NaN included."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: must precede every triton import

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402

from gyrfalcon.kernels.argmax import CHUNK, argmax_rows  # noqa: E402


@pytest.mark.parametrize("vocab", [1, 7, CHUNK, CHUNK + 1, 2 * CHUNK + 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_on_random_rows(vocab, dtype):
    x = torch.randn(5, vocab, generator=torch.Generator().manual_seed(vocab)).to(dtype)
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_ties_and_special_values_follow_torch():
    vocab = 3 * CHUNK + 5
    x = torch.zeros(6, vocab)
    x[0, [CHUNK + 3, 5, 2 * CHUNK]] = 4.0  # tie across chunks: the smallest index
    x[1, [2 * CHUNK + 1, 3 * CHUNK + 4]] = 4.0  # tie in later chunks only
    x[2] = float("-inf")  # nothing finite: index 0
    x[3, [9, CHUNK + 9]] = float("nan")  # NaN wins, the first one
    x[3, 3] = float("inf")
    x[4, -1] = float("inf")  # the last entry of a ragged last chunk
    x[5, [CHUNK - 1, CHUNK]] = 1.0  # tie on a chunk edge
    got = argmax_rows(x)
    assert got.tolist() == [5, 2 * CHUNK + 1, 0, 9, vocab - 1, CHUNK - 1]
    assert torch.equal(got, x.argmax(dim=-1))


def test_strided_rows_and_empty_batch():
    x = torch.randn(4, 2 * CHUNK + 30)[:, : CHUNK + 17]  # row stride != vocab
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert argmax_rows(torch.empty(0, 10)).shape == (0,)
