"""Shared fixtures: tiny random HF models (generated, never downloaded) and SmolLM2."""

from __future__ import annotations

import os

import pytest
import torch

TINY_ARCHS = ("llama", "llama-tied", "llama3-rope", "mistral", "qwen2", "qwen3")


def make_tiny_hf_model(path: str, arch: str = "llama", seed: int = 0, **overrides):
    """Save a tiny random HF causal LM (float32) into path; returns the HF model."""
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
    else:
        raise ValueError(arch)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    # Larger-than-default init so greedy continuations are not one repeated token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(path)
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
