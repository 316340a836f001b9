"""Normalized model configuration: read the HF config once, here.

Nothing downstream reads an HF config object; it reads `ModelConfig`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

# HF architecture name -> our model family
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "moe",
    "MixtralForCausalLM": "moe",
}


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    rope_scaling: dict[str, Any] | None = None
    hidden_act: str = "silu"
    torch_dtype: str | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Mixture of experts (num_experts 0: a dense model). A MoE layer's router takes the
    # softmax over all experts, keeps the top num_experts_per_tok and renormalizes them
    # to sum to one iff norm_topk_prob; each expert is a gated MLP of
    # moe_intermediate_size. The layers in moe_layers are MoE, the rest dense MLPs of
    # intermediate_size (Qwen3-MoE's decoder_sparse_step and mlp_only_layers).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()
    # HF keeps Mixtral's top-k weights float32 (the expert outputs are scaled in float32,
    # then rounded); Qwen3-MoE rounds them to the model dtype first
    router_weights_fp32: bool = False

    @property
    def family(self) -> str:
        return ARCHITECTURES[self.architecture]

    @classmethod
    def from_hf(cls, hf: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {sorted(ARCHITECTURES)}"
            )
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        head_dim = hf.get("head_dim") or hidden // num_heads
        model_type = hf.get("model_type", "llama")
        qkv_bias = bool(hf.get("attention_bias", model_type == "qwen2"))
        qk_norm = model_type in ("qwen3", "qwen3_moe")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}")
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        rope_params = hf.get("rope_parameters")  # transformers 5 layout
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            if rope_params.get("rope_type", "default") != "default":
                rope_scaling = rope_params
        if (
            rope_scaling is not None
            and rope_scaling.get("rope_type", rope_scaling.get("type", "default")) == "default"
        ):
            rope_scaling = None
        eos: list[int] = []
        for src in (generation or {}, hf):
            val = src.get("eos_token_id")
            if val is None:
                continue
            for t in val if isinstance(val, list) else [val]:
                if t not in eos:
                    eos.append(int(t))
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            rope_scaling=rope_scaling,
            hidden_act=act,
            torch_dtype=hf.get("torch_dtype") or hf.get("dtype"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos),
            **_moe_fields(hf, arch),
        )

    @classmethod
    def from_dir(cls, path: str) -> ModelConfig:
        with open(os.path.join(path, "config.json")) as f:
            hf = json.load(f)
        gen = None
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_path):
            with open(gen_path) as f:
                gen = json.load(f)
        return cls.from_hf(hf, gen)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @property
    def attention_weights(self) -> int:
        """The weights of one layer's q, k, v and o projections (biases and norms aside)."""
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        return self.hidden_size * (q + 2 * kv) + q * self.hidden_size


def _moe_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """The MoE fields of `ModelConfig` from an HF config (none for a dense model).

    Mixtral: every layer is MoE, experts of intermediate_size, top-k always
    renormalized. Qwen3-MoE: experts of moe_intermediate_size, renormalized iff
    norm_topk_prob (HF's default False); layer i is MoE unless it is in
    mlp_only_layers or (i + 1) is not a multiple of decoder_sparse_step.
    NOTE: transformers 5 writes Qwen3-MoE's expert count as num_local_experts, the
    published checkpoints as num_experts.
    """
    layers = hf["num_hidden_layers"]
    if arch == "MixtralForCausalLM":
        num_experts = int(hf["num_local_experts"])
        fields = dict(
            moe_intermediate_size=int(hf["intermediate_size"]),
            norm_topk_prob=True,
            moe_layers=tuple(range(layers)),
            router_weights_fp32=True,
        )
    elif arch == "Qwen3MoeForCausalLM":
        num_experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
        step = int(hf.get("decoder_sparse_step") or 1)
        dense = set(hf.get("mlp_only_layers") or ())
        sparse = tuple(
            i for i in range(layers) if i not in dense and num_experts > 0 and (i + 1) % step == 0
        )
        fields = dict(
            moe_intermediate_size=int(hf["moe_intermediate_size"]),
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            moe_layers=sparse,
        )
    else:
        return {}
    if num_experts == 0:
        return dict(fields, moe_layers=())  # NOTE: HF builds dense MLPs only then
    top_k = int(hf["num_experts_per_tok"])
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"{top_k} experts per token out of {num_experts}")
    return dict(fields, num_experts=num_experts, num_experts_per_tok=top_k)
