"""Sparse mixture-of-experts: a top-k softmax router and E gated-MLP experts, sharded
over the TP group one of two ways (`ParallelContext.ep_size`).

Experts are stored fused, per rank: w13 [E_local, 2 I_local, H] (each expert's gate
rows, then its up rows) and w2 [E_local, H, I_local]. Expert e of token t computes
down(silu(gate x) * up x); the layer's output is the router-weighted sum over the
token's top-k experts.

MoE-TP (ep_size 1): every rank holds all E experts with the intermediate dim split
(column-parallel w13, row-parallel w2); each rank computes every routed (token,
slot) pair on its I / tp slice and one all-reduce sums the partial outputs.

EP (ep_size == tp_size): rank r holds experts [r E/ep, (r+1) E/ep) whole. Dispatch
is "all-gather the tokens, compute the owned experts, reduce":
  * under TP attention (the engine today) every rank of the group already holds the
    same tokens after attention's all-reduce, so the gather is free and skipped: each
    rank runs only the (token, slot) pairs routed to its experts (ids of other ranks'
    experts become -1 and are skipped) and one all-reduce of [T, H] combines them;
  * ranks bringing their own tokens (DP attention; `forward(..., tokens_local=True)`)
    all-gather them first (`all_gather_rows`: each rank's rows padded to the most of
    any rank; padding rows route to no expert), every rank routes all of them, and a
    reduce-scatter hands each rank the sums of its own rows: half an all-reduce's
    traffic (where a DP group has several TP ranks, which must hold the same bits of
    their group's rows, an all-reduce, and each takes its group's TP rank 0's copy).
Cost under TP attention: one all-reduce of [T, H] a layer, the same bytes as MoE-TP;
under DP attention an all-gather and a reduce-scatter of [ranks R, H], together an
all-reduce's bytes. An all-to-all dispatch would send each token only to the ranks
owning its k experts and combine back the same way: fewer bytes once ep exceeds k,
for a count exchange and a permutation. Compute per rank is the (token, slot) pairs
routed to its experts: T k / ep on average, more on the rank holding hot experts (EP
does not balance load).

The expert compute is one call, `fused_experts`: the fused GPU kernel
(`kernels/fused_moe.fused_moe`, the contract of `moe_reference`, host-free, so CUDA
graphs capture MoE models) on CUDA; `moe_reference` on the CPU and wherever fused
kernels are off. The reference asks the host which experts have tokens, so a model
running it on CUDA captures no graph.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gyrfalcon.kernels.dispatch import KernelPolicy
from gyrfalcon.layers.context import LayerContext


def route_topk(
    logits: torch.Tensor, top_k: int, renormalize: bool, weights_fp32: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (top-k weights [T, k], expert ids [T, k] int64), as HF.

    p = softmax(logits) in float32; the k largest p (torch.topk: HF's choice among
    ties too); divided by their sum when `renormalize`. The weights stay float32 when
    `weights_fp32` (HF Mixtral), else are rounded to the logits' dtype (Qwen3-MoE).
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not weights_fp32:
        weights = weights.to(logits.dtype)
    return weights, ids


class TopKRouter(nn.Module):
    """The gate: logits = x W^T over all E experts (replicated on every rank), then
    `route_topk`."""

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, renormalize: bool, weights_fp32: bool
    ):
        super().__init__()
        self.top_k, self.renormalize, self.weights_fp32 = top_k, renormalize, weights_fp32
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, H] -> (weights [T, k], ids [T, k])
        logits = F.linear(x, self.weight)
        return route_topk(logits, self.top_k, self.renormalize, self.weights_fp32)


def moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The experts' weighted sum: the CPU path and the fused kernel's reference.

    x [T, H]; w13 [E, 2 I, H] (gate rows then up rows); w2 [E, H, I]; topk_weights
    [T, k] (float32 or x's dtype); topk_ids [T, k] integer. Returns [T, H] in x's dtype:

        out[t] = sum_j  round(w[t, j] * down_e(silu(gate_e x_t) * up_e x_t)),  e = ids[t, j]

    where round is to x's dtype (each product is computed in the promoted dtype of
    the expert output and the weight, as HF does); the sum is accumulated in float32
    over the experts in increasing id order and rounded once. Slots whose id is
    outside [0, E) contribute nothing: under EP they name other ranks' experts.
    NOTE: asks the host which experts have tokens (a sync; not CUDA-graph safe).
    """
    num_experts, inter = w13.shape[0], w2.shape[2]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    valid = (topk_ids >= 0) & (topk_ids < num_experts)
    for e in topk_ids[valid].unique().tolist():
        # NOTE: slot-major, HF's order: the same GEMM rows give HF's bits on the CPU
        slots, rows = (topk_ids == e).T.nonzero(as_tuple=True)  # tokens routed to e, and where
        gate_up = F.linear(x[rows], w13[e])  # [n, 2 I]
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = F.linear(h, w2[e]) * topk_weights[rows, slots, None]  # [n, H]
        out.index_add_(0, rows, y.to(x.dtype).float())
    return out.to(x.dtype)


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    kernels: KernelPolicy,
    routed_experts: int | None = None,
) -> torch.Tensor:
    """`moe_reference`'s result: the fused GPU kernel on CUDA (the same contract, ids
    outside [0, E) skipped; its blocks sized for the pairs routed over `routed_experts`,
    every rank's experts under EP), the reference otherwise. The one place the kernel
    plugs in."""
    if kernels.use_fused(x):
        from gyrfalcon.kernels.fused_moe import fused_moe

        return fused_moe(
            x, w13, w2, topk_weights, topk_ids, routed_experts=routed_experts, pdl=kernels.pdl
        )
    return moe_reference(x, w13, w2, topk_weights, topk_ids)


class MoeExperts(nn.Module):
    """This rank's experts (`ParallelContext.experts`): w13 [E_local, 2 I_local, H],
    w2 [E_local, H, I_local]; loads HF per-expert tensors (shard ids "gate:e",
    "up:e", "down:e" for global expert e) or fused ones of every expert (no shard id)."""

    def __init__(
        self, hidden_size: int, num_experts: int, intermediate_size: int, ctx: LayerContext
    ):
        super().__init__()
        self.kernels = ctx.kernels
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        group, _ = ctx.parallel.moe_group
        self.shard = shard = group.experts(num_experts, intermediate_size)
        n, inter = shard.num_experts, shard.inter_size
        self.w13 = nn.Parameter(torch.empty(n, 2 * inter, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(n, hidden_size, inter), requires_grad=False)

    def shard_ids(self, name: str) -> list[str]:
        """The per-expert parts that make up parameter `name` on this rank."""
        parts = ("gate", "up") if name == "w13" else ("down",)
        experts = range(self.shard.start, self.shard.start + self.shard.num_experts)
        return [f"{part}:{e}" for e in experts for part in parts]

    def owns(self, expert: int) -> bool:
        return self.shard.owns(expert)

    def load(self, name: str, loaded: torch.Tensor, shard_id: str | None = None) -> None:
        """Copy this rank's share of an HF tensor into w13 or w2: of one expert's gate,
        up or down projection ([I, H], [I, H], [H, I]; nothing when another rank owns
        the expert), or of every expert's ([E, 2 I, H] gate then up, [E, H, I])."""
        s, inter = self.shard, self.intermediate_size
        if shard_id is None:
            _check_shape(f"every expert's {name}", loaded, self._full_shape(name))
            mine = loaded.narrow(0, s.start, s.num_experts)
            if name == "w13":
                for half in range(2):  # gate rows, then up rows
                    src = mine.narrow(1, half * inter + s.inter_start, s.inter_size)
                    self.w13.data.narrow(1, half * s.inter_size, s.inter_size).copy_(src)
            else:
                self.w2.data.copy_(mine.narrow(2, s.inter_start, s.inter_size))
            return
        part, expert = shard_id.split(":")
        assert (part == "down") == (name == "w2") and part in ("gate", "up", "down"), shard_id
        e = int(expert)
        if not s.owns(e):
            return
        if part == "down":
            _check_shape(f"expert {e} down", loaded, self._full_shape("w2")[1:])
            self.w2.data[e - s.start].copy_(loaded.narrow(1, s.inter_start, s.inter_size))
            return
        _check_shape(f"expert {e} {part}", loaded, (inter, self.w13.shape[2]))
        row = s.inter_size if part == "up" else 0  # gate rows, then up rows
        dst = self.w13.data[e - s.start].narrow(0, row, s.inter_size)
        dst.copy_(loaded.narrow(0, s.inter_start, s.inter_size))

    def _full_shape(self, name: str) -> tuple[int, ...]:
        hidden, inter = self.w13.shape[2], self.intermediate_size
        if name == "w13":
            return (self.num_experts, 2 * inter, hidden)
        return (self.num_experts, hidden, inter)

    def forward(
        self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        """This rank's part of the experts' weighted sum: [T, H], to be summed over the
        group (its I slice of every expert, or its experts whole)."""
        s = self.shard
        if s.num_experts != self.num_experts:  # EP: other ranks' experts are skipped
            local = topk_ids - s.start
            topk_ids = local.masked_fill((local < 0) | (local >= s.num_experts), -1)
        return fused_experts(
            x, self.w13, self.w2, topk_weights, topk_ids, self.kernels, self.num_experts
        )


def _check_shape(what: str, loaded: torch.Tensor, want: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != tuple(want):
        raise ValueError(f"checkpoint tensor for {what} is {list(loaded.shape)}, want {list(want)}")


class SparseMoeBlock(nn.Module):
    """Router (`gate`) + `experts` + the combine over the group: replaces the MLP."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        weights_fp32: bool,
        ctx: LayerContext,
    ):
        super().__init__()
        self.parallel, self.tokens_local = ctx.parallel.moe_group
        # the rank whose copy of this rank's rows the combine returns: under DP attention
        # every TP rank of a DP group brings the group's rows, and all of them take the
        # copy of the group's TP rank 0 (the all-reduce sums each copy in its own float
        # order, and the group's TP ranks must hold the same bits)
        first = self.parallel.tp_rank
        self.rows_from = first - ctx.parallel.tp_rank if self.tokens_local else first
        # the combine: a reduce-scatter where every rank takes its own block (ranks bring
        # their own rows: DP groups of one rank), half an all-reduce's traffic; else an
        # all-reduce and the block of `rows_from` (the same on every rank of the group)
        self.scatter = not self.tokens_local or ctx.parallel.tp_size == 1
        self.gate = TopKRouter(hidden_size, num_experts, top_k, renormalize, weights_fp32)
        self.experts = MoeExperts(hidden_size, num_experts, intermediate_size, ctx)

    @torch.inference_mode()
    def warm_up_kernels(self, max_tokens: int) -> None:
        """Run this rank's experts (no collective) at the token counts that build every
        fused-kernel variant a batch of up to max_tokens tokens needs
        (`warm_up_token_counts`): no eager step builds one while serving. On CUDA only."""
        from gyrfalcon.kernels.fused_moe import warm_up_token_counts

        w13 = self.experts.w13
        if not self.experts.kernels.use_fused(w13):
            return
        local = self.experts.shard.num_experts
        for t in warm_up_token_counts(local, self.gate.top_k, max_tokens, self.experts.num_experts):
            x = torch.zeros(t, w13.shape[2], dtype=w13.dtype, device=w13.device)
            self.experts(x, *self.gate(x))  # NOTE: the router's dtypes, as in serving

    def forward(self, x: torch.Tensor, tokens_local: bool | None = None) -> torch.Tensor:
        """x [T, H] (post-attention-normed) -> [T, H], reduced over the group.

        tokens_local (default: the layer context's `moe_group`): this rank's tokens
        are its own (DP attention), not the group's shared ones: they are gathered from
        every rank first and this rank's rows of the result returned. Every rank of the
        group must pass the same value.
        """
        if tokens_local is None:
            tokens_local = self.tokens_local
        if not tokens_local:
            return self.parallel.all_reduce(self.experts(x, *self.gate(x)))
        rows = x.shape[0]
        x, counts = self.parallel.all_gather_rows(x)  # [ranks R, H], padded to R rows each
        width = x.shape[0] // len(counts)
        topk_weights, topk_ids = self.gate(x)
        if min(counts) < width:  # NOTE: eager steps only: graphs gather equal rows
            topk_ids = topk_ids.masked_fill(padding_rows(counts, width, x.device)[:, None], -1)
        y = self.experts(x, topk_weights, topk_ids)
        if self.scatter:  # every rank takes its own block: each gets only its sums
            return self.parallel.reduce_scatter(y)[:rows]
        start = self.rows_from * width
        return self.parallel.all_reduce(y)[start : start + rows]


def padding_rows(counts: list[int], width: int, device: torch.device) -> torch.Tensor:
    """[len(counts) width] bool: the padding rows of a gather that padded rank r's
    counts[r] rows to `width` (rank r's block is rows [r width, (r + 1) width), its own
    rows first). They route to no expert (ids -1): no compute, and zeros in the sum."""
    assert all(0 <= n <= width for n in counts), (counts, width)
    pad = torch.arange(width) >= torch.tensor(counts)[:, None]  # [ranks, width]
    return pad.reshape(-1).to(device, non_blocking=True)
