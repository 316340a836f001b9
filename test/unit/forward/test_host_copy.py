"""host_tensor builds through `array` where it can: it must give what torch.tensor
gives, values, dtype and shape, for every list a step uploads, and fall back to it
for the rest."""

import pytest
import torch

from gyrfalcon.forward.host_copy import host_tensor, upload, upload_tensor

CPU = torch.device("cpu")

CASES = [
    ([3, -1, 2**40], torch.int64),  # a step's index upload: beyond int32
    ([7, 8], torch.int32),
    ([[0.1, 0.7], [1.0, 2.5e-8]], torch.float32),  # the sampler's [3, rows] floats
    ([[1, 0, 2], [4, 5, 6]], torch.int64),
    ([0.1, 1e300], torch.float64),
    ([True, False], torch.int64),
    ([], torch.int64),  # empty: torch.tensor's own path
    ([[]], torch.int64),
    ([1.5, -2.5], torch.int64),  # floats into ints: torch.tensor's truncation
    ([1, 0], torch.bool),  # no array code: torch.tensor
]


@pytest.mark.parametrize("data,dtype", CASES)
def test_host_tensor_equals_torch_tensor(data, dtype):
    got, want = host_tensor(data, dtype, CPU), torch.tensor(data, dtype=dtype)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    assert torch.equal(upload(data, dtype, CPU), want)


def test_lists_torch_tensor_refuses_are_refused_alike():
    with pytest.raises(ValueError):
        host_tensor([[1], [2, 3]], torch.int64, CPU)  # ragged
    with pytest.raises(RuntimeError):
        host_tensor([2**40], torch.int32, CPU)  # out of range


def test_upload_tensor_keeps_values_dtype_and_shape():
    t = torch.arange(12, dtype=torch.int64).view(3, 4) * 2**40
    got = upload_tensor(t, CPU)
    assert got.dtype == t.dtype and torch.equal(got, t)


@pytest.mark.parametrize("data", [[3, -1, 2**40], [7], []])
def test_upload_int64_equals_torch_tensor(data):
    from array import array

    from gyrfalcon.forward.host_copy import upload_int64

    got = upload_int64(array("q", data), CPU)
    assert got.dtype == torch.int64 and torch.equal(got, torch.tensor(data, dtype=torch.int64))
