"""Shared fixtures: tiny random HF models (generated, never downloaded) and SmolLM2."""

from __future__ import annotations

import os

import pytest
import torch

TINY_ARCHS = ("llama", "llama-tied", "llama3-rope", "mistral", "qwen2", "qwen3")
TINY_MOE_ARCHS = ("qwen3-moe", "mixtral")
# a random EAGLE3 drafter that fits SmolLM2-135M (`make_tiny_eagle3`)
SMOLLM2_SHAPE = dict(
    hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
    vocab_size=49152, draft_vocab_size=2048, target_hidden_size=576,
    max_position_embeddings=8192, rope_theta=100000.0,
)  # fmt: skip


def make_tiny_hf_model(
    path: str, arch: str = "llama", seed: int = 0, save_original_format: bool = True, **overrides
):
    """Save a tiny random HF causal LM (float32) into path; returns the HF model.

    MoE archs (`TINY_MOE_ARCHS`): Qwen3-MoE with 8 experts, top-3, experts of 32;
    Mixtral with 4 experts, top-2, experts of 32 (its intermediate_size). Saved in the
    published checkpoints' per-expert layout, or with `save_original_format=False`
    fused, as transformers 5 holds them (`experts.gate_up_proj`, `experts.down_proj`)."""
    import transformers as tf

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=arch == "llama-tied",
        eos_token_id=2,
        bos_token_id=1,
    )
    common.update(overrides)
    if arch in ("llama", "llama-tied"):
        cfg = tf.LlamaConfig(**common, rope_theta=10000.0)
        cls = tf.LlamaForCausalLM
    elif arch == "llama3-rope":
        scaling = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        cfg = tf.LlamaConfig(**common, rope_theta=500000.0, rope_scaling=scaling)
        cls = tf.LlamaForCausalLM
    elif arch == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=None)
        cls = tf.MistralForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**common)
        cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=32)
        cls = tf.Qwen3ForCausalLM
    elif arch == "qwen3-moe":
        moe = dict(moe_intermediate_size=32, num_experts=8, num_experts_per_tok=3)
        moe.update(norm_topk_prob=True, head_dim=16)
        cfg = tf.Qwen3MoeConfig(**{**common, **moe, **overrides})
        cls = tf.Qwen3MoeForCausalLM
    elif arch == "mixtral":
        moe = dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
        cfg = tf.MixtralConfig(**{**common, **moe, **overrides})
        cls = tf.MixtralForCausalLM
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    # Larger-than-default init so greedy continuations are not one repeated token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:  # NOTE: 3-D: fused MoE experts; dense models have none
                p.normal_(0, 0.2)
    # NOTE: transformers 4 has no save_original_format (and no fused experts)
    fused = {} if save_original_format else {"save_original_format": False}
    model.save_pretrained(path, **fused)
    return model


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, str]:
    dirs = {}
    for arch in TINY_ARCHS:
        path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
        make_tiny_hf_model(path, arch)
        dirs[arch] = path
    return dirs


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> str:
    """The embedded SmolLM2-135M-Instruct, converted once per session (or from the cache)."""
    from gyrfalcon.loader.resolve import resolve_model

    cache = os.environ.get("GYRFALCON_CACHE") or str(tmp_path_factory.mktemp("gyr-cache"))
    return resolve_model(None, cache)


def tiny_eagle3_config(**overrides) -> dict:
    """The config.json of a tiny EAGLE3 drafter for a target of make_tiny_hf_model's shape
    (vocab 256, hidden 64), as SGLang and vLLM load it."""
    hf = dict(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        max_position_embeddings=256,
        vocab_size=256,
        draft_vocab_size=32,
        target_hidden_size=64,
        tie_word_embeddings=False,
        hidden_act="silu",
    )
    hf.update(overrides)
    return hf


def tiny_target_config(num_layers: int = 8):
    """The ModelConfig of make_tiny_hf_model's Llama with num_layers layers (no weights)."""
    from gyrfalcon.config.model_config import ModelConfig

    shape = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=8)
    return ModelConfig.from_hf(dict(shape, num_hidden_layers=num_layers, num_key_value_heads=2))


def make_tiny_eagle3(
    path: str, seed: int = 0, embed_tokens: bool = False, **overrides
) -> dict[str, torch.Tensor]:
    """Save a tiny random EAGLE3 drafter (float32, `tiny_eagle3_config(**overrides)`) into
    path in the tensor names SGLang and vLLM load; `embed_tokens` adds the embedding some
    checkpoints carry. Returns its tensors."""
    import json

    from safetensors.torch import save_file

    hf = tiny_eagle3_config(**overrides)
    h, vocab, draft_vocab = hf["hidden_size"], hf["vocab_size"], hf["draft_vocab_size"]
    hd = hf.get("head_dim") or h // hf["num_attention_heads"]
    q, kv = hf["num_attention_heads"] * hd, hf["num_key_value_heads"] * hd
    inter = hf["intermediate_size"]
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    attn, mlp = "midlayer.self_attn", "midlayer.mlp"
    tensors = {
        "fc.weight": rand(h, 3 * hf["target_hidden_size"], scale=0.1),
        f"{attn}.q_proj.weight": rand(q, 2 * h),
        f"{attn}.k_proj.weight": rand(kv, 2 * h),
        f"{attn}.v_proj.weight": rand(kv, 2 * h),
        f"{attn}.o_proj.weight": rand(h, q),
        f"{mlp}.gate_proj.weight": rand(inter, h),
        f"{mlp}.up_proj.weight": rand(inter, h),
        f"{mlp}.down_proj.weight": rand(h, inter),
        "lm_head.weight": rand(draft_vocab, h),
    }
    norms = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
    for norm in [f"midlayer.{n}" for n in norms] + ["norm"]:
        tensors[f"{norm}.weight"] = 1 + rand(h, scale=0.1)
    # a draft vocabulary of random target ids, in increasing order (as trainers write it)
    hot = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    tensors["d2t"] = hot - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[hot] = True
    tensors["t2d"] = t2d
    if embed_tokens:
        tensors["embed_tokens.weight"] = rand(vocab, h)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return tensors
