"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2*d] laid out as [gate | up] -> silu(gate) * up: [..., d]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
