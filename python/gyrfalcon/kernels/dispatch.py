"""Where fused Triton kernels replace the torch reference ops: `KernelPolicy`.

NOTE: only on CUDA tensors. The CPU path stays the torch code that matches HF
transformers bit for bit; kernel modules are imported lazily, inside the CUDA
branch, because Triton picks interpreter vs compiler at import time.

A policy is a value, made once per model (the executor builds it from the server
arguments) and handed to every layer, the KV cache, the attention backends and the
sampler; nothing here is process-wide.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass

import torch


@functools.cache
def _has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


@dataclass(frozen=True)
class KernelPolicy:
    """How one model's layers run their ops.

    fused: fused Triton kernels may run on CUDA tensors (False: the torch reference
        code everywhere; tests compare the kernels against it).
    pdl: kernels may launch with programmatic dependent launch (`--disable-pdl`
        turns it off); the kernels launch that way only where the device supports
        it (`kernels/device.pdl_supported`).
    """

    fused: bool = True
    pdl: bool = True

    def use_fused(self, x: torch.Tensor) -> bool:
        return self.fused and x.is_cuda and _has_triton()

    def use_skinny_gemm(self, x: torch.Tensor) -> bool:
        """Whether a linear layer on x [M, K] runs our one-launch skinny GEMM (decode-
        sized M, 16-bit CUDA tensors; float32 stays on cuBLAS, which the HF-exactness
        tests use)."""
        if not (self.use_fused(x) and x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16)):
            return False
        from gyrfalcon.kernels.gemv import MAX_SKINNY_M

        return 1 <= x.shape[0] <= MAX_SKINNY_M

    def use_norm_skinny_gemm(self, x: torch.Tensor) -> bool:
        """Whether add+RMSNorm folds into the next skinny GEMM: one row (batch-1 decode)
        of at most NORM_FUSED_MAX_K elements (small models, where launches dominate)."""
        if not self.use_skinny_gemm(x) or x.shape[0] != 1:
            return False
        from gyrfalcon.kernels.gemv import NORM_FUSED_MAX_K

        return x.shape[1] <= NORM_FUSED_MAX_K


# The production default: fused kernels on CUDA, launched with PDL where supported.
DEFAULT_KERNELS = KernelPolicy()
# The torch reference ops on every device (what the fused kernels are tested against).
TORCH_REFERENCE = KernelPolicy(fused=False, pdl=False)
