"""Mixture-of-experts decoders: Qwen3-MoE (qk-norm; dense MLP layers where
`mlp_only_layers` / `decoder_sparse_step` put them) and Mixtral (every layer MoE).

The Llama decoder with the MLP swapped for the sparse MoE block (`layers/moe.py`):
attention, embedding, LM head and the EAGLE3 hooks are Llama's. TP-agnostic like
it: the MoE block shards itself by the layer context (MoE-TP or EP,
`ParallelContext.ep_size`).

Checkpoint names: Qwen3-MoE's `mlp.gate.weight` and
`mlp.experts.{e}.{gate,up,down}_proj.weight`; Mixtral's `block_sparse_moe.gate.weight`
and `block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`; and either one as transformers 5
holds it in memory (`save_pretrained(save_original_format=False)`): `mlp.gate.weight`,
`mlp.experts.gate_up_proj` [E, 2 I, H], `mlp.experts.down_proj` [E, H, I].
"""

from __future__ import annotations

import torch
from torch import nn

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.forward.parallel import ParallelContext
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.layers.moe import MoeExperts, SparseMoeBlock
from gyrfalcon.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from gyrfalcon.models.weights import WeightLoader, expert_param


class MoeDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer with the sparse MoE block for its MLP (a dense Llama MLP
    in Qwen3-MoE's `mlp_only_layers`)."""

    def build_mlp(self, cfg: ModelConfig, layer_id: int, ctx: LayerContext) -> nn.Module:
        if layer_id not in cfg.moe_layers:
            return LlamaMLP(cfg, ctx)
        return SparseMoeBlock(
            cfg.hidden_size,
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
            cfg.norm_topk_prob,
            cfg.router_weights_fp32,
            ctx,
        )

    def mlp_out(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        x_partial: ParallelContext | None,
        defer: ParallelContext | None,
    ) -> tuple[torch.Tensor, torch.Tensor, ParallelContext | None]:
        if isinstance(self.mlp, LlamaMLP):
            return super().mlp_out(x, residual, x_partial, defer)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual, x_partial)
        return self.mlp(x), residual, None  # NOTE: the sparse block sums its own output


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen3MoeForCausalLM and MixtralForCausalLM (their differences are config)."""

    decoder_layer = MoeDecoderLayer

    @property
    def captures_cuda_graphs(self) -> bool:
        """Only with fused kernels on: the reference experts ask the host which experts
        have tokens (`layers/moe.py`)."""
        return all(m.kernels.fused for m in self.modules() if isinstance(m, MoeExperts))

    def load_tensor(
        self, loader: WeightLoader, name: str, tensor: torch.Tensor, hf_name: str
    ) -> None:
        """Expert tensors into the fused expert weights (this rank's share); the rest
        as Llama's."""
        name = _our_name(name)
        expert = expert_param(name)
        if expert is None:
            loader.load(name, tensor, hf_name)
        else:
            loader.load(expert[0], tensor, hf_name, shard_id=expert[1])

    def keeps_weight(self, hf_name: str) -> bool:
        """Whether this rank needs checkpoint tensor `hf_name` at all: not another
        rank's expert under expert parallelism (the loader then never reads it)."""
        expert = expert_param(_our_name(hf_name.removeprefix("model.")))
        if expert is None or expert[2] is None:
            return True
        try:
            experts = self.get_submodule(expert[0].rpartition(".")[0])
        except AttributeError:
            return True  # NOTE: no place for it: the loader says so
        return not isinstance(experts, MoeExperts) or experts.owns(expert[2])


def _our_name(name: str) -> str:
    """Mixtral's classic `block_sparse_moe` is our (and transformers 5's) `mlp`."""
    return name.replace(".block_sparse_moe.", ".mlp.")
