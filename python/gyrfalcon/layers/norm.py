"""RMSNorm: float32 math like the HF reference; a fused Triton kernel on CUDA."""

from __future__ import annotations

import torch
from torch import nn

from gyrfalcon.layers.context import LayerContext


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ctx: LayerContext):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.kernels = ctx.kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., hidden]
        if self.kernels.use_fused(x):
            from gyrfalcon.kernels.norm import rmsnorm

            return rmsnorm(x, self.weight, self.eps, pdl=self.kernels.pdl)
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); fused and in place on CUDA."""
        if self.kernels.use_fused(x):
            from gyrfalcon.kernels.norm import fused_add_rmsnorm

            return fused_add_rmsnorm(x, residual, self.weight, self.eps, pdl=self.kernels.pdl)
        h = x + residual
        return self.forward(h), h
