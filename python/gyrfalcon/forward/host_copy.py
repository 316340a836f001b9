"""Host-to-device uploads that never block the host on the device.

A blocking `.to(cuda)` of a pageable CPU tensor waits for the stream to drain,
which would serialize the host's planning of step N+1 behind step N's kernels.
Uploads here go through pinned memory with non_blocking=True; the caching host
allocator keeps each pinned buffer alive until its copy has run.
"""

from __future__ import annotations

import torch


def host_tensor(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A CPU tensor of `data`, pinned when it is bound for a CUDA device."""
    t = torch.tensor(data, dtype=dtype)
    return t.pin_memory() if device.type == "cuda" else t


def upload(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Copy a (nested) Python list to `device` without blocking the host on CUDA."""
    return host_tensor(data, dtype, device).to(device, non_blocking=True)
