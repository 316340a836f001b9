"""Roofline arithmetic on the published model shapes, and the bandwidth probe on CPU."""

from __future__ import annotations

import math

import pytest
import torch
from bench_scripts import bench_model_config

from gyrfalcon.bench.bandwidth import best_rate, measure_read_bandwidth
from gyrfalcon.bench.roofline import (
    kv_read_bytes,
    param_count,
    roofline_step_ms,
    tokens_per_s,
    weight_bytes,
)
from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.models.llama import LlamaForCausalLM


def test_model_configs_load_with_published_shapes() -> None:
    llama, qwen, smol = (
        bench_model_config(n) for n in ("llama-3.1-8b", "qwen3-8b", "smollm2-135m")
    )
    assert (llama.num_layers, llama.hidden_size, llama.intermediate_size) == (32, 4096, 14336)
    assert (llama.num_heads, llama.num_kv_heads, llama.head_dim) == (32, 8, 128)
    assert llama.vocab_size == 128256 and not llama.tie_word_embeddings
    assert llama.rope_theta == 500000.0 and llama.max_position_embeddings == 131072
    assert llama.rope_scaling is not None and llama.rope_scaling["rope_type"] == "llama3"
    assert llama.rope_scaling["factor"] == 8.0
    assert llama.rope_scaling["original_max_position_embeddings"] == 8192
    assert (qwen.architecture, qwen.num_layers, qwen.intermediate_size) == (
        "Qwen3ForCausalLM",
        36,
        12288,
    )
    assert qwen.qk_norm and qwen.head_dim == 128 and qwen.vocab_size == 151936
    assert qwen.rope_theta == 1e6 and qwen.rms_norm_eps == 1e-6
    assert qwen.max_position_embeddings == 40960
    assert (smol.num_layers, smol.hidden_size, smol.num_heads, smol.num_kv_heads) == (30, 576, 9, 3)
    assert smol.tie_word_embeddings and smol.vocab_size == 49152 and smol.intermediate_size == 1536


@pytest.mark.parametrize("name", ["llama-3.1-8b", "qwen3-8b", "smollm2-135m"])
def test_param_count_matches_the_model_module(name: str) -> None:
    cfg = bench_model_config(name)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, LayerContext())
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_param_count_with_qkv_bias() -> None:
    cfg = ModelConfig.from_hf(
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "vocab_size": 100,
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "tie_word_embeddings": True,
        }
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, LayerContext())
    assert cfg.qkv_bias
    assert param_count(cfg) == sum(p.numel() for p in model.parameters())


def test_llama_weight_bytes() -> None:
    cfg = bench_model_config("llama-3.1-8b")
    assert param_count(cfg) == 8_030_261_248
    assert weight_bytes(cfg, 2) == 16_060_522_496  # ~16.06e9
    # without the untied input embedding table (a decode step gathers only a row of it)
    assert weight_bytes(cfg, 2, count_input_embedding=False) == 16_060_522_496 - 2 * 128256 * 4096


def test_tied_lm_head_counted_once() -> None:
    cfg = bench_model_config("smollm2-135m")
    assert param_count(cfg) == 134_515_008
    assert weight_bytes(cfg, 4) == 4 * 134_515_008
    # the tied matrix is the LM head, which reads all of it: it stays
    assert weight_bytes(cfg, 4, count_input_embedding=False) == 4 * 134_515_008


def test_kv_read_bytes() -> None:
    cfg = bench_model_config("llama-3.1-8b")
    assert kv_read_bytes(cfg, 64, 1024, 2) == 2 * 32 * 8 * 128 * 2 * 1024 * 64  # ~8.6e9
    assert kv_read_bytes(cfg, 1, 1, 2) == 131072
    qwen = bench_model_config("qwen3-8b")
    assert kv_read_bytes(qwen, 2, 10, 2) == 2 * 10 * 2 * 36 * 8 * 128 * 2


def test_roofline_matches_the_issue_figure() -> None:
    cfg = bench_model_config("llama-3.1-8b")
    w = weight_bytes(cfg, 2)
    step = roofline_step_ms(w, 0, 3.04e12)
    assert step == pytest.approx(5.283, abs=1e-3)
    assert tokens_per_s(1, step) == pytest.approx(189.3, abs=0.1)
    # with 1024 tokens of context the KV adds ~0.13 GB: still ~188 tokens/s
    step_ctx = roofline_step_ms(w, kv_read_bytes(cfg, 1, 1024, 2), 3.04e12)
    assert 187 < tokens_per_s(1, step_ctx) < 189
    # at batch 64, 1024 context the KV bytes are about half the weight bytes
    step64 = roofline_step_ms(w, kv_read_bytes(cfg, 64, 1024, 2), 3.04e12)
    assert step64 == pytest.approx((16.06e9 + 8.59e9) / 3.04e12 * 1e3, rel=1e-3)
    with pytest.raises(ValueError):
        roofline_step_ms(w, 0, 0.0)


def test_best_rate_takes_the_fastest_iteration() -> None:
    assert best_rate(1000, [0.5, 0.25, 1.0]) == 4000.0
    with pytest.raises(ValueError):
        best_rate(1000, [0.0])


@pytest.mark.parametrize("method", ["sum", "copy"])
def test_cpu_bandwidth_is_plausible(method: str) -> None:
    bw = measure_read_bandwidth("cpu", nbytes=8 << 20, iters=3, method=method)
    assert math.isfinite(bw) and 1e8 < bw < 1e13


def test_bandwidth_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        measure_read_bandwidth("cpu", nbytes=1 << 20, method="scan")
    with pytest.raises(ValueError):
        measure_read_bandwidth("cpu", nbytes=1 << 20, iters=0)
