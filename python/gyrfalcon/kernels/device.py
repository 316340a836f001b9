"""Device facts the kernels' launch heuristics use."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; a nominal 2 elsewhere (the Triton
    interpreter, where a few large programs run fastest: each program costs it Python
    time, and at 8 the CPU spec tests spent most of theirs in split-KV decode programs
    of a few tokens each)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 2


@functools.cache
def gpu_name(device: torch.device) -> str:
    """The CUDA device's name (e.g. "NVIDIA H200"), for launch tables measured on one
    model of GPU; "" elsewhere."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return ""


@functools.cache
def pdl_supported(device: torch.device) -> bool:
    """Whether kernels on `device` can launch with programmatic dependent launch: they
    may start while the previous kernel finishes, and wait (`gdc_wait`) before they
    touch anything but weights and the batch's metadata (`kernels/pdl.pdl_gate`).
    Hopper and later only; never under the CPU interpreter."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def launch_pdl(x: torch.Tensor, allowed: bool) -> bool:
    """Whether a kernel on x's device launches with PDL: when the caller allows it (its
    `KernelPolicy.pdl`) and the device supports it."""
    return allowed and pdl_supported(x.device)
