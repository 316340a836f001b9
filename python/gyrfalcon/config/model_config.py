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
        qk_norm = model_type == "qwen3"
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
