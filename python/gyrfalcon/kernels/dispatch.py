"""Where fused Triton kernels replace the torch reference ops.

NOTE: only on CUDA tensors. The CPU path stays the torch code that matches HF
transformers bit for bit; kernel modules are imported lazily, inside the CUDA
branch, because Triton picks interpreter vs compiler at import time.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
from collections.abc import Iterator

import torch


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


_reference_only = False


@contextlib.contextmanager
def torch_reference_ops() -> Iterator[None]:
    """Inside this block layers run their torch reference code on CUDA too
    (tests compare the fused kernels against it)."""
    global _reference_only
    old, _reference_only = _reference_only, True
    try:
        yield
    finally:
        _reference_only = old


def use_fused(x: torch.Tensor) -> bool:
    return x.is_cuda and not _reference_only and _has_triton()


def use_skinny_gemm(x: torch.Tensor) -> bool:
    """Whether a linear layer on x [M, K] runs our one-launch skinny GEMM (decode-sized
    M, 16-bit CUDA tensors; float32 stays on cuBLAS, which the HF-exactness tests use)."""
    if not (use_fused(x) and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    from gyrfalcon.kernels.gemv import MAX_SKINNY_M

    return 1 <= x.shape[0] <= MAX_SKINNY_M


def use_norm_skinny_gemm(x: torch.Tensor) -> bool:
    """Whether add+RMSNorm folds into the next skinny GEMM: one row (batch-1 decode)
    of at most NORM_FUSED_MAX_K elements (small models, where launches dominate)."""
    if not use_skinny_gemm(x) or x.shape[0] != 1:
        return False
    from gyrfalcon.kernels.gemv import NORM_FUSED_MAX_K

    return x.shape[1] <= NORM_FUSED_MAX_K
