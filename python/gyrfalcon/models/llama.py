"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2 qkv-bias, Qwen3 qk-norm).

TP-agnostic: parallel layers carry their own loaders and reduces (the layer context
says which rank this is); `packed_modules` maps HF checkpoint names onto our fused
layers. For a drafter (EAGLE3) the model exposes its embedding (`embed`, and
`embed_tokens` to share), its LM head (`compute_logits`) and the residual stream
entering chosen layers (`forward_aux`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from gyrfalcon.config.draft_config import default_aux_layers as eagle3_aux_layers
from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.parallel import ParallelContext
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.layers.embedding import LMHead, VocabEmbedding
from gyrfalcon.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from gyrfalcon.layers.norm import RMSNorm
from gyrfalcon.layers.rotary import RotaryEmbedding
from gyrfalcon.models.weights import LLAMA_PACKED_MODULES, WeightLoader

__all__ = [
    "LlamaAttention",
    "LlamaDecoderLayer",
    "LlamaForCausalLM",
    "LlamaMLP",
    "eagle3_aux_layers",  # the default aux layers of an EAGLE3 drafter (config/)
]


class LlamaAttention(nn.Module):
    """Attention over this rank's heads (all of them at tp 1)."""

    def __init__(
        self, cfg: ModelConfig, layer_id: int, ctx: LayerContext, input_size: int | None = None
    ):
        """input_size: the width qkv_proj reads (cfg.hidden_size unless given: an EAGLE3
        midlayer reads concat(embedding, hidden), twice that)."""
        super().__init__()
        self.layer_id = layer_id
        self.kernels = ctx.kernels
        heads = ctx.parallel.heads(cfg.num_heads, cfg.num_kv_heads)
        self.num_heads, self.num_kv_heads = heads.num_heads, heads.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = heads.num_heads * cfg.head_dim
        self.kv_size = heads.num_kv_heads * cfg.head_dim
        self.qkv_proj = QKVParallelLinear(
            input_size or cfg.hidden_size,
            cfg.head_dim,
            cfg.num_heads,
            cfg.num_kv_heads,
            ctx,
            bias=cfg.qkv_bias,
        )
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, ctx)
        self.rotary = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, ctx
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ctx) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, ctx) if cfg.qk_norm else None

    def forward(
        self, positions: torch.Tensor, qkv: torch.Tensor, batch: ForwardBatch, reduce: bool = True
    ) -> torch.Tensor:
        """Attention from the qkv projection (the decoder layer runs qkv_proj, with the
        input norm folded in where it pays): [T, q + 2 kv] of this rank's heads ->
        [T, hidden], reduced over TP by o_proj (reduce=False: this rank's part)."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        backend, layer = batch.attn_backend, self.layer_id
        if not self.kernels.use_fused(q):
            q, k = self.rotary(positions, q, k)
            out = backend.forward(q, k, v, layer, batch)
        elif backend.fuses_rope(batch):  # NOTE: RoPE inside the attention kernel
            out = backend.attend_rope(q, k, v, positions, self.rotary.cos_sin_table(), layer, batch)
        else:  # NOTE: rotary and the KV-cache write in one kernel
            cache, loc = batch.kv_cache, batch.out_cache_loc
            self.rotary.forward_and_store(positions, q, k, v, cache.k[layer], cache.v[layer], loc)
            out = backend.attend(q, layer, batch)
        return self.o_proj(out, reduce)


class LlamaMLP(nn.Module):
    """The gated MLP's projections; the decoder layer runs them (gate_up with the
    post-attention norm folded in where it pays, down with SiLU-and-mul)."""

    def __init__(self, cfg: ModelConfig, ctx: LayerContext):
        super().__init__()
        size = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            cfg.hidden_size, [size, size], ctx, shard_ids=["gate", "up"]
        )
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, ctx)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, ctx: LayerContext, attn_input_size: int | None = None
    ):
        """attn_input_size: what the attention's qkv_proj reads (`LlamaAttention`)."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.self_attn = LlamaAttention(cfg, layer_id, ctx, attn_input_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        self.mlp = self.build_mlp(cfg, layer_id, ctx)

    def build_mlp(self, cfg: ModelConfig, layer_id: int, ctx: LayerContext) -> nn.Module:
        """The layer's MLP (a subclass's own: the MoE decoders' sparse block)."""
        return LlamaMLP(cfg, ctx)

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
        h, residual, _ = self.forward_deferred(positions, h, residual, batch, None, None)
        return h, residual

    def forward_deferred(
        self,
        positions: torch.Tensor,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        batch: ForwardBatch,
        h_partial: ParallelContext | None,
        defer: ParallelContext | None,
    ) -> tuple[torch.Tensor, torch.Tensor, ParallelContext | None]:
        """`forward` with the TP sums moved into the add+norm after them, where one
        kernel sums, adds and normalizes (`RMSNorm.add_and_norm`'s partial_of).
        h_partial: h is a partial sum over that group. defer: the TP group whose sums
        may be left to the next add+norm: the attention's output always (this layer's
        post-attention norm sums it), the MLP's where it is dense. Returns (h,
        residual, the group the returned h is a partial sum over, or None)."""
        attn = self.self_attn
        qkv, residual = attn.qkv_proj.forward_normed(h, residual, self.input_layernorm, h_partial)
        x = attn(positions, qkv, batch, reduce=defer is None)
        return self.mlp_out(x, residual, defer, defer)

    def mlp_out(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        x_partial: ParallelContext | None,
        defer: ParallelContext | None,
    ) -> tuple[torch.Tensor, torch.Tensor, ParallelContext | None]:
        """(the MLP's output delta, the residual stream, the group that delta is a partial
        sum over or None) from the attention's x (x_partial, defer: `forward_deferred`)."""
        mlp = self.mlp
        gate_up, residual = mlp.gate_up_proj.forward_normed(
            x, residual, self.post_attention_layernorm, x_partial
        )
        return mlp.down_proj.forward_silu_mul(gate_up, reduce=defer is None), residual, defer


class LlamaForCausalLM(nn.Module):
    packed_modules = LLAMA_PACKED_MODULES
    # what each layer is built as: (cfg, layer id, ctx) -> module (the MoE models' own)
    decoder_layer: type[nn.Module] = LlamaDecoderLayer

    def __init__(
        self, cfg: ModelConfig, ctx: LayerContext, embed_tokens: VocabEmbedding | None = None
    ):
        """embed_tokens: another model's embedding to share (a drafter shares its
        target's): neither built nor loaded here."""
        super().__init__()
        self.cfg = cfg
        self.shares_embedding = embed_tokens is not None
        if embed_tokens is None:
            embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, ctx)
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(self.decoder_layer(cfg, i, ctx) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ctx)
        tied = self.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, ctx, tied)
        # NOTE: over TP, each sum of a layer's output moves into the add+norm after it
        self.defer = ctx.parallel if ctx.parallel.tp_size > 1 else None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states after the final norm: [T, hidden]."""
        return self._run(batch, ())[0]

    def forward_aux(
        self, batch: ForwardBatch, aux_layers: Sequence[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """(forward(batch), aux) where aux[j] [T, hidden] is the residual stream entering
        layer aux_layers[j]: the embedding output for layer 0, else the previous layer's
        input plus its attention and MLP outputs, before this layer's input norm.
        That is HF's `output_hidden_states` hidden_states[i] for i < num_layers (what
        EAGLE3 reads, at layers `eagle3_aux_layers(num_layers)`).

        NOTE: each is a fresh tensor (the fused add+norm kernels later overwrite the
        residual buffers in place); `forward` computes none of them.
        """
        for i in aux_layers:
            if not 0 <= i < len(self.layers):
                raise ValueError(f"aux layer {i} is not in [0, {len(self.layers)})")
        return self._run(batch, aux_layers)

    def _run(
        self, batch: ForwardBatch, aux_layers: Sequence[int]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        h = self.embed(batch.input_ids)
        residual: torch.Tensor | None = None
        captured: dict[int, torch.Tensor] = {}
        partial: ParallelContext | None = None  # the TP group h is a partial sum over
        for i, layer in enumerate(self.layers):
            if i in aux_layers:
                if partial is not None:
                    h, partial = partial.all_reduce(h), None
                captured[i] = h.clone() if residual is None else h + residual
            h, residual, partial = layer.forward_deferred(
                batch.positions, h, residual, batch, partial, self.defer
            )
        hidden = self.norm.add_and_norm(h, residual, partial)[0]
        return hidden, [captured[i] for i in aux_layers]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings: ids [T] -> [T, hidden]."""
        return self.embed_tokens(ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> [N, vocab] in the model dtype (HF rounds the LM head's
        output to it too); consumers upcast where they need float32, so a greedy decode
        step never writes a float32 copy."""
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises if any parameter is left unloaded."""
        expected = {n for n, _ in self.named_parameters()}
        if self.cfg.tie_word_embeddings:
            expected.discard("lm_head.weight")
        if self.shares_embedding:
            expected.discard("embed_tokens.weight")
        loader = WeightLoader(self, self.packed_modules)
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue
            if name == "embed_tokens.weight" and self.shares_embedding:
                continue  # NOTE: the owner of the shared embedding loads it
            self.load_tensor(loader, name, tensor, hf_name)
        loader.check(expected)

    def load_tensor(
        self, loader: WeightLoader, name: str, tensor: torch.Tensor, hf_name: str
    ) -> None:
        """Place one checkpoint tensor (`name`: `hf_name` without "model.")."""
        loader.load(name, tensor, hf_name)
