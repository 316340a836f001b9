"""RMSNorm: float32 math like the HF reference; a fused Triton kernel on CUDA."""

from __future__ import annotations

import torch
from torch import nn

from gyrfalcon.kernels.dispatch import use_fused


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden]
        if use_fused(x):
            from gyrfalcon.kernels.norm import rmsnorm

            return rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); fused and in place on CUDA."""
        if use_fused(x):
            from gyrfalcon.kernels.norm import fused_add_rmsnorm

            return fused_add_rmsnorm(x, residual, self.weight, self.eps)
        h = x + residual
        return self.forward(h), h
