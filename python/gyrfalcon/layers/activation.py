"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gyrfalcon.kernels.dispatch import KernelPolicy


def silu_and_mul(x: torch.Tensor, kernels: KernelPolicy) -> torch.Tensor:
    """x: [..., 2*d] laid out as [gate | up] -> silu(gate) * up: [..., d]."""
    if kernels.use_fused(x) and x.dim() == 2:
        from gyrfalcon.kernels.activation import silu_and_mul as fused

        return fused(x)
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
