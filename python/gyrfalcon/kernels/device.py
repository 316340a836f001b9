"""Device facts the kernels' launch heuristics use."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a nominal 8 elsewhere (the Triton
    interpreter, where a few large programs run fastest)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8
