"""Where fused Triton kernels replace the torch reference ops.

NOTE: only on CUDA tensors. The CPU path stays the torch code that matches HF
transformers bit for bit; kernel modules are imported lazily, inside the CUDA
branch, because Triton picks interpreter vs compiler at import time.
"""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_fused(x: torch.Tensor) -> bool:
    return x.is_cuda and _has_triton()
