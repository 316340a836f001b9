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


_pdl_enabled = True  # the default; `--disable-pdl` turns it off


def set_launch_pdl(enabled: bool) -> None:
    """Process-wide: launch the Triton kernels with programmatic dependent launch where
    the device supports it (unless `--disable-pdl`). Set once, by the worker, at start."""
    global _pdl_enabled
    _pdl_enabled = enabled


@functools.cache
def _pdl_supported(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def launch_pdl(x: torch.Tensor) -> bool:
    """Whether a kernel on x's device launches with programmatic dependent launch: it may
    start while the previous kernel finishes, and waits (`gdc_wait`) before it touches
    anything but weights. Hopper and later only; never under the CPU interpreter."""
    return _pdl_enabled and _pdl_supported(x.device)
