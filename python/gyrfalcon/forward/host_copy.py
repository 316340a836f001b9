"""Host-to-device uploads that never block the host on the device.

A blocking `.to(cuda)` of a pageable CPU tensor waits for the stream to drain,
which would serialize the host's planning of step N+1 behind step N's kernels.
Uploads here go through pinned memory with non_blocking=True; the caching host
allocator keeps each pinned buffer alive until its copy has run.
"""

from __future__ import annotations

import array
import itertools

import torch

# array type codes of the dtypes `host_tensor` builds through `array` (C-speed list
# conversion: torch.tensor inspects every element of a Python list, ~5x slower for the
# ~1,000 ints of a step's index upload)
_ARRAY_CODES = {torch.int64: "q", torch.int32: "i", torch.float32: "f", torch.float64: "d"}


def _from_array(data: list, dtype: torch.dtype) -> torch.Tensor | None:
    """`data` (a flat list, or a rectangular list of lists) as a CPU tensor through
    `array`; None where that does not apply (another dtype, ragged or empty rows,
    elements array refuses), for torch.tensor to handle as before."""
    code = _ARRAY_CODES.get(dtype)
    if code is None or not data:
        return None
    try:
        if isinstance(data[0], list):
            width = len(data[0])
            if width == 0 or any(not isinstance(r, list) or len(r) != width for r in data):
                return None
            buf = array.array(code, itertools.chain.from_iterable(data))
            shape: tuple[int, ...] = (len(data), width)
        else:
            buf = array.array(code, data)
            shape = (len(data),)
    except (TypeError, OverflowError):  # NOTE: torch.tensor then raises its own error
        return None
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def _pinned_for(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """CPU tensor t, pinned when it is bound for a CUDA device."""
    return t.pin_memory() if device.type == "cuda" else t


def host_tensor(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A CPU tensor of `data`, pinned when it is bound for a CUDA device."""
    t = _from_array(data, dtype)
    if t is None:
        t = torch.tensor(data, dtype=dtype)
    return _pinned_for(t, device)


def upload(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Copy a (nested) Python list to `device` without blocking the host on CUDA."""
    return host_tensor(data, dtype, device).to(device, non_blocking=True)


def upload_int64(data: array.array, device: torch.device) -> torch.Tensor:
    """Copy an int64 array (type code "q") to `device` without blocking the host on
    CUDA; on the CPU the tensor shares the array's memory."""
    assert data.typecode == "q", f"an int64 array, not {data.typecode!r}"
    if not data:  # NOTE: torch.frombuffer refuses an empty buffer
        return torch.zeros(0, dtype=torch.int64, device=device)
    return upload_tensor(torch.frombuffer(data, dtype=torch.int64), device)


def upload_tensor(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy CPU tensor t to `device` without blocking the host on CUDA."""
    return _pinned_for(t, device).to(device, non_blocking=True)
