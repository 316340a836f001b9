"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2 qkv-bias, Qwen3 qk-norm).

TP-agnostic: parallel layers carry their own loaders; `packed_modules` maps
HF checkpoint names onto our fused layers.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.kernels.dispatch import use_fused
from gyrfalcon.layers.embedding import LMHead, VocabEmbedding
from gyrfalcon.layers.linear import ColumnParallelLinear, RowParallelLinear
from gyrfalcon.layers.norm import RMSNorm
from gyrfalcon.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
        )
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q, kv
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [q, kv, kv], bias=cfg.qkv_bias, shard_ids=["q", "k", "v"]
        )
        self.o_proj = RowParallelLinear(q, cfg.hidden_size)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self, positions: torch.Tensor, qkv: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """Attention from the qkv projection (the decoder layer runs qkv_proj, with the
        input norm folded in where it pays): [T, q + 2 kv] -> [T, hidden]."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        backend, layer = batch.attn_backend, self.layer_id
        if not use_fused(q):
            q, k = self.rotary(positions, q, k)
            out = backend.forward(q, k, v, layer, batch)
        elif backend.fuses_rope(batch):  # NOTE: RoPE inside the attention kernel
            out = backend.attend_rope(q, k, v, positions, self.rotary.cos_sin_table(), layer, batch)
        else:  # NOTE: rotary and the KV-cache write in one kernel
            cache, loc = batch.kv_cache, batch.out_cache_loc
            self.rotary.forward_and_store(positions, q, k, v, cache.k[layer], cache.v[layer], loc)
            out = backend.attend(q, layer, batch)
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """The gated MLP's projections; the decoder layer runs them (gate_up with the
    post-attention norm folded in where it pays, down with SiLU-and-mul)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, [size, size], shard_ids=["gate", "up"]
        )
        self.down_proj = RowParallelLinear(size, cfg.hidden_size)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(
        self,
        positions: torch.Tensor,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's output delta, residual stream); the next layer adds them.

        NOTE: x + residual is the same float sum as HF's residual + x, so float32
        output still matches HF exactly on CPU; on CUDA add+norm is one kernel, folded
        into the next projection for a batch-1 row of a small model (forward_normed).
        """
        attn, mlp = self.self_attn, self.mlp
        qkv, residual = attn.qkv_proj.forward_normed(h, residual, self.input_layernorm)
        x = attn(positions, qkv, batch)
        gate_up, residual = mlp.gate_up_proj.forward_normed(
            x, residual, self.post_attention_layernorm
        )
        return mlp.down_proj.forward_silu_mul(gate_up), residual


class LlamaForCausalLM(nn.Module):
    # HF checkpoint name fragment -> (our module name fragment, shard id)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        tied = self.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states after the final norm: [T, hidden]."""
        h = self.embed_tokens(batch.input_ids)
        residual = None
        for layer in self.layers:
            h, residual = layer(batch.positions, h, residual, batch)
        return self.norm.add_and_norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, vocab] in the model dtype (HF rounds the LM head's
        output to it too); consumers upcast where they need float32, so a greedy decode
        step never writes a float32 copy."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises if any parameter is left unloaded."""
        modules = dict(self.named_modules())
        expected = {n for n, _ in self.named_parameters()}
        if self.cfg.tie_word_embeddings:
            expected.discard("lm_head.weight")
        loaded: set[str] = set()  # "param" or "param:shard" for packed layers
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            shard_id = None
            for frag, (ours, sid) in self.packed_modules.items():
                if f".{frag}." in name:
                    name, shard_id = name.replace(f".{frag}.", f".{ours}."), sid
                    break
            module_name, _, param = name.rpartition(".")
            module = modules.get(module_name)
            if module is None or not hasattr(module, param):
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in the model")
            if hasattr(module, "load"):
                module.load(param, tensor, shard_id)
            else:
                getattr(module, param).data.copy_(tensor)
            loaded.add(name if shard_id is None else f"{name}:{shard_id}")
        for mod_name, mod in modules.items():
            if isinstance(mod, ColumnParallelLinear) and len(mod.shard_ids) > 1:
                for pname in ("weight", "bias") if mod.bias is not None else ("weight",):
                    full = f"{mod_name}.{pname}"
                    if all(f"{full}:{sid}" in loaded for sid in mod.shard_ids):
                        loaded.add(full)
        missing = {n for n in expected if n not in loaded}
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {sorted(missing)[:8]}")
