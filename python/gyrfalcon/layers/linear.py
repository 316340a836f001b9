"""Linear layers that carry their own weight loaders (TP-aware by construction).

A packed layer (qkv, gate_up) owns one fused weight; HF checkpoints store the
parts separately, so each part is loaded by shard id into its row range.
With tp_size > 1 each rank keeps its slice: column layers split output rows,
row layers split input columns (the caller all-reduces their output).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gyrfalcon.kernels.dispatch import use_norm_skinny_gemm, use_skinny_gemm
from gyrfalcon.layers.activation import silu_and_mul
from gyrfalcon.layers.norm import RMSNorm


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b): our skinny GEMM for decode-sized batches on CUDA (one launch, no
    split-K reduce), cuBLAS otherwise."""
    if bias is None and use_skinny_gemm(x):
        from gyrfalcon.kernels.gemv import skinny_linear

        return skinny_linear(x, weight)
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W split by output rows over TP ranks.

    `output_sizes` lists the full (unsharded) sizes of the packed parts, in order.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool = False,
        tp_rank: int = 0,
        tp_size: int = 1,
        shard_ids: list[str] | None = None,
    ):
        super().__init__()
        for size in output_sizes:
            assert size % tp_size == 0, f"output size {size} not divisible by tp {tp_size}"
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.local_sizes = [s // tp_size for s in output_sizes]
        self.shard_ids = shard_ids or [str(i) for i in range(len(output_sizes))]
        out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def _rows(self, shard_id: str | None) -> tuple[int, int]:
        if shard_id is None:
            return 0, sum(self.local_sizes)
        idx = self.shard_ids.index(shard_id)
        start = sum(self.local_sizes[:idx])
        return start, self.local_sizes[idx]

    def load(self, name: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        """Copy a full HF tensor (weight or bias) into this rank's slice."""
        param = self.weight if name == "weight" else self.bias
        assert param is not None, f"layer has no {name}"
        start, size = self._rows(shard_id)
        part = loaded.narrow(0, self.tp_rank * size, size)
        param.data.narrow(0, start, size).copy_(part)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def forward_normed(
        self, h: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(norm(h + residual)), h + residual); residual None means h alone is
        normalized and is the residual. One launch for a batch-1 decode row of a small
        model on CUDA (`norm_skinny_linear`); the norm, then forward, otherwise."""
        if self.bias is None and use_norm_skinny_gemm(h):
            from gyrfalcon.kernels.gemv import norm_skinny_linear

            return norm_skinny_linear(h, residual, norm.weight, norm.eps, self.weight)
        if residual is None:
            return self(norm(h)), h
        x, residual = norm.add_and_norm(h, residual)
        return self(x), residual


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input columns; the caller reduces over TP."""

    def __init__(self, input_size: int, output_size: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        assert input_size % tp_size == 0
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.local_in = input_size // tp_size
        self.weight = nn.Parameter(torch.empty(output_size, self.local_in), requires_grad=False)

    def load(self, name: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        assert name == "weight" and shard_id is None
        self.weight.data.copy_(loaded.narrow(1, self.tp_rank * self.local_in, self.local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, None)

    def forward_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """forward(silu_and_mul(gate_up)); one kernel for a single row on CUDA."""
        if use_skinny_gemm(gate_up):
            from gyrfalcon.kernels.gemv import FUSED_SILU_MUL_MAX_M, skinny_linear

            if gate_up.shape[0] <= FUSED_SILU_MUL_MAX_M:
                return skinny_linear(gate_up, self.weight, act_silu_mul=True)
        return self(silu_and_mul(gate_up))
