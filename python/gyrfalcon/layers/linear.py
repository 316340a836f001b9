"""Linear layers that carry their own weight loaders (TP-aware by construction).

A packed layer (qkv, gate_up) owns one fused weight; HF checkpoints store the
parts separately, so each part is loaded by shard id into its row range. Every
rank loads the full HF tensors and keeps its slice: column layers keep output
rows (each part split on its own), row layers keep input columns and all-reduce
their output through the layer context, so each returns the full result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gyrfalcon.forward.parallel import ParallelContext
from gyrfalcon.kernels.dispatch import KernelPolicy
from gyrfalcon.layers.activation import silu_and_mul
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.layers.norm import RMSNorm


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernels: KernelPolicy
) -> torch.Tensor:
    """x W^T (+ b): our skinny GEMM for decode-sized batches on CUDA (one launch, no
    split-K reduce), cuBLAS otherwise."""
    if bias is None and kernels.use_skinny_gemm(x):
        from gyrfalcon.kernels.gemv import skinny_linear

        return skinny_linear(x, weight, pdl=kernels.pdl)
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """y = x W^T (+ b) with W split by output rows over TP ranks.

    `output_sizes` lists the full (unsharded) sizes of the packed parts, in order;
    each part splits evenly unless `shards` gives, per part, the (start, length) of
    the rows of the full part this rank holds.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        ctx: LayerContext,
        bias: bool = False,
        shard_ids: list[str] | None = None,
        shards: list[tuple[int, int]] | None = None,
    ):
        super().__init__()
        self.kernels = ctx.kernels
        self.output_sizes = list(output_sizes)
        self.shards = shards or [ctx.parallel.even_shard(size) for size in output_sizes]
        assert len(self.shards) == len(output_sizes), (self.shards, output_sizes)
        for (start, size), full in zip(self.shards, output_sizes):
            assert 0 <= start and start + size <= full, (start, size, full)
        self.local_sizes = [size for _, size in self.shards]
        self.shard_ids = shard_ids or [str(i) for i in range(len(output_sizes))]
        out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None

    def load(self, name: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        """Copy this rank's rows of a full HF tensor (weight or bias): of one part
        (shard_id), or of every part when the tensor holds them all, packed."""
        param = self.weight if name == "weight" else self.bias
        assert param is not None, f"layer has no {name}"
        parts = range(len(self.shards)) if shard_id is None else [self.shard_ids.index(shard_id)]
        for idx in parts:
            src = sum(self.output_sizes[:idx]) if shard_id is None else 0
            start, size = self.shards[idx]
            dst = sum(self.local_sizes[:idx])
            param.data.narrow(0, dst, size).copy_(loaded.narrow(0, src + start, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernels)

    def forward_normed(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        norm: RMSNorm,
        partial_of: ParallelContext | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(forward(norm(h + residual)), h + residual); residual None means h alone is
        normalized and is the residual. One launch for a batch-1 decode row of a small
        model on CUDA (`norm_skinny_linear`); the norm, then forward, otherwise.
        partial_of: h is a partial sum over that TP group (`RMSNorm.add_and_norm`)."""
        if partial_of is not None and (residual is None or self.kernels.use_norm_skinny_gemm(h)):
            h, partial_of = partial_of.all_reduce(h), None
        if self.bias is None and self.kernels.use_norm_skinny_gemm(h):
            from gyrfalcon.kernels.gemv import norm_skinny_linear

            return norm_skinny_linear(
                h, residual, norm.weight, norm.eps, self.weight, pdl=self.kernels.pdl
            )
        if residual is None:
            return self(norm(h)), h
        x, residual = norm.add_and_norm(h, residual, partial_of)
        return self(x), residual


class QKVParallelLinear(ColumnParallelLinear):
    """The packed q, k, v projection, split by attention heads (`ParallelContext.heads`):
    each rank holds its query heads and its KV heads, one replicated KV head when tp
    exceeds the KV heads. Shard ids "q", "k", "v"."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        ctx: LayerContext,
        bias: bool = False,
    ):
        heads = ctx.parallel.heads(num_heads, num_kv_heads)
        q = (heads.head_start * head_dim, heads.num_heads * head_dim)
        kv = (heads.kv_head_start * head_dim, heads.num_kv_heads * head_dim)
        full_q, full_kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(
            hidden_size,
            [full_q, full_kv, full_kv],
            ctx,
            bias=bias,
            shard_ids=["q", "k", "v"],
            shards=[q, kv, kv],
        )


class RowParallelLinear(nn.Module):
    """y = x W^T with W split by input columns over TP ranks: each rank multiplies its
    slice of x and the partial products are all-reduced, so every rank gets all of y."""

    def __init__(self, input_size: int, output_size: int, ctx: LayerContext):
        super().__init__()
        self.kernels, self.parallel = ctx.kernels, ctx.parallel
        self.in_start, self.local_in = ctx.parallel.even_shard(input_size)
        self.weight = nn.Parameter(torch.empty(output_size, self.local_in), requires_grad=False)

    def load(self, name: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        assert name == "weight" and shard_id is None
        self.weight.data.copy_(loaded.narrow(1, self.in_start, self.local_in))

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """x: [T, local_in] -> [T, output_size], reduced over TP; with reduce=False this
        rank's partial product (the caller sums it: `RMSNorm.add_and_norm`'s partial_of)."""
        partial = linear(x, self.weight, None, self.kernels)
        return self.parallel.all_reduce(partial) if reduce else partial

    def forward_silu_mul(self, gate_up: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """forward(silu_and_mul(gate_up), reduce); one kernel for a single row on CUDA."""
        if self.kernels.use_skinny_gemm(gate_up):
            from gyrfalcon.kernels.gemv import FUSED_SILU_MUL_MAX_M, skinny_linear

            if gate_up.shape[0] <= FUSED_SILU_MUL_MAX_M:
                partial = skinny_linear(
                    gate_up, self.weight, act_silu_mul=True, pdl=self.kernels.pdl
                )
                return self.parallel.all_reduce(partial) if reduce else partial
        return self(silu_and_mul(gate_up, self.kernels), reduce)
