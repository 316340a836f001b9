"""RMSNorm: float32 math like the HF reference; a fused Triton kernel on CUDA."""

from __future__ import annotations

import torch
from torch import nn

from gyrfalcon.forward.parallel import ParallelContext
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
        self, x: torch.Tensor, residual: torch.Tensor, partial_of: ParallelContext | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); fused and in place on CUDA. partial_of: x
        is a partial sum over that TP group, summed here first, with the add and norm in
        the same kernel where the group's communicator has one for x (like its
        all-reduce, whatever the kernel policy: `ParallelContext.reduce_add_rmsnorm`)."""
        if partial_of is not None:
            fused = partial_of.reduce_add_rmsnorm(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
            x = partial_of.all_reduce(x)
        if self.kernels.use_fused(x):
            from gyrfalcon.kernels.norm import fused_add_rmsnorm

            return fused_add_rmsnorm(x, residual, self.weight, self.eps, pdl=self.kernels.pdl)
        h = x + residual
        return self.forward(h), h
