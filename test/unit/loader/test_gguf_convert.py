"""Tests for GGUF -> HF conversion on tiny synthetic GGUF files with known weights."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from gguf import GGUFWriter, RopeScalingType
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from gyrfalcon.loader import gguf_convert
from gyrfalcon.loader.gguf_convert import convert_gguf_to_hf, gguf_to_hf_name
from gyrfalcon.loader.hf_weights import iter_hf_weights


def _weights(path: str) -> dict[str, torch.Tensor]:
    return dict(iter_hf_weights(path, show_progress=False))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[3, 70, 255, 259, 12, 200, 45, 9, 1]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def _json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tie", [False, True])
def test_weights_config_and_logits_match_source_model(make_tiny_gguf, tmp_path, arch, tie):
    tiny = make_tiny_gguf(arch=arch, tie=tie)
    out = convert_gguf_to_hf(tiny.path, str(tmp_path / "hf"))
    assert out == str(tmp_path / "hf")
    expected = {
        k: v for k, v in tiny.model.state_dict().items() if not (tie and k == "lm_head.weight")
    }
    got = _weights(out)
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], value), name
    if arch == "qwen2":
        assert "model.layers.1.self_attn.k_proj.bias" in got
    config = _json(os.path.join(out, "config.json"))
    assert config["model_type"] == arch
    assert config["tie_word_embeddings"] is tie
    assert (config["num_hidden_layers"], config["hidden_size"]) == (2, 32)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert (config["intermediate_size"], config["vocab_size"]) == (64, 263)
    assert config["rms_norm_eps"] == 1e-5 and config["torch_dtype"] == "float32"
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(loaded) is type(tiny.model)
    torch.testing.assert_close(_logits(loaded), _logits(tiny.model), rtol=0, atol=1e-6)


def test_quantized_tensors_are_dequantized_in_hf_shape(make_tiny_gguf, tmp_path):
    tiny = make_tiny_gguf(quant="Q8_0", tie=False)
    got = _weights(convert_gguf_to_hf(tiny.path, str(tmp_path / "hf")))
    for name, value in tiny.model.state_dict().items():
        assert got[name].shape == value.shape, name
        # Q8_0 keeps ~8 bits per weight: errors are below 1% of each block's max
        torch.testing.assert_close(got[name], value, rtol=0, atol=0.01 * value.abs().max().item())


def test_tokenizer_and_generation_config(make_tiny_gguf, tmp_path):
    tiny = make_tiny_gguf()
    out = convert_gguf_to_hf(tiny.path, str(tmp_path / "hf"))
    source = AutoTokenizer.from_pretrained(os.path.dirname(tiny.path), gguf_file="tiny.gguf")
    saved = AutoTokenizer.from_pretrained(out)
    for text in ["Hello world", "Hello <|im_end|> again", " spaces  and\nnewlines ü"]:
        assert saved(text).input_ids == source(text).input_ids
    assert saved("Hello").input_ids == [259]  # the fully merged "Hello" token
    assert saved.chat_template == source.chat_template and "<|im_end|>" in saved.chat_template
    gen = _json(os.path.join(out, "generation_config.json"))
    # tokenizer/GGUF eos <|endoftext|> (260) plus the chat template's end-of-turn token
    assert gen["eos_token_id"] == [260, 262]
    assert gen["bos_token_id"] == 260


def test_sharded_output_when_over_shard_limit(make_tiny_gguf, tmp_path):
    tiny = make_tiny_gguf()
    out = convert_gguf_to_hf(tiny.path, str(tmp_path / "hf"), max_shard_bytes=20_000)
    files = os.listdir(out)
    assert "model.safetensors" not in files
    index = _json(os.path.join(out, "model.safetensors.index.json"))
    shards = set(index["weight_map"].values())
    assert len(shards) > 1 and shards <= set(files)
    got = _weights(out)
    for name, value in tiny.model.state_dict().items():
        assert torch.equal(got[name], value), name


def test_llama3_rope_scaling_recovered_from_rope_freqs(make_tiny_gguf, tmp_path):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    cfg = AutoConfig.for_model(
        "llama",
        hidden_size=32,
        num_attention_heads=4,
        max_position_embeddings=131072,
        rope_parameters=params,
    )
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    default = 500000.0 ** -(torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    factors = (default / scaled.double()).numpy()
    assert factors.max() > 1.0, "test vector should exercise the scaling"
    tiny = make_tiny_gguf(rope_freqs=factors, rope_theta=500000.0)
    out = convert_gguf_to_hf(tiny.path, str(tmp_path / "hf"))
    config = _json(os.path.join(out, "config.json"))
    scaling = config["rope_scaling"]
    assert scaling.pop("rope_type") == "llama3"
    assert scaling == pytest.approx(
        {k: v for k, v in params.items() if k not in ("rope_type", "rope_theta")}
    )
    assert config["rope_theta"] == 500000.0
    assert "rope_freqs.weight" not in _weights(out)

    bad = make_tiny_gguf(name="bad.gguf", rope_freqs=np.array([1.0, 3.0, 1.0, 7.0]))
    with pytest.raises(ValueError, match="rope_freqs"):
        convert_gguf_to_hf(bad.path, str(tmp_path / "bad"))


def test_linear_rope_scaling(make_tiny_gguf, tmp_path):
    def linear(writer: GGUFWriter) -> None:
        writer.add_rope_scaling_type(RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(4.0)

    tiny = make_tiny_gguf(metadata_hook=linear)
    out = convert_gguf_to_hf(tiny.path, str(tmp_path / "hf"))
    config = _json(os.path.join(out, "config.json"))
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    assert AutoConfig.from_pretrained(out).rope_parameters["factor"] == 4.0


@pytest.mark.parametrize(
    "hook,match",
    [
        (lambda w: w.add_rope_scaling_type(RopeScalingType.YARN), "rope scaling type 'yarn'"),
        (lambda w: w.add_rope_dimension_count(4), "partial rotary"),
    ],
)
def test_unsupported_rope_layouts_raise(make_tiny_gguf, tmp_path, hook, match):
    tiny = make_tiny_gguf(metadata_hook=hook)
    with pytest.raises(ValueError, match=match):
        convert_gguf_to_hf(tiny.path, str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")


def _leftovers(parent) -> list[str]:
    return [n for n in os.listdir(parent) if n.endswith(".tmp")]


def test_unsupported_architecture(tmp_path):
    path = str(tmp_path / "phi.gguf")
    writer = GGUFWriter(path, "phi2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'phi2'"):
        convert_gguf_to_hf(path, str(tmp_path / "out"))
    assert not os.path.exists(tmp_path / "out") and not _leftovers(tmp_path)


def test_failure_midway_leaves_no_output(make_tiny_gguf, tmp_path, monkeypatch):
    tiny = make_tiny_gguf()

    def broken(*args, **kwargs):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(gguf_convert, "_write_tokenizer", broken)
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_gguf_to_hf(tiny.path, str(tmp_path / "hf"))
    assert not os.path.exists(tmp_path / "hf")
    assert not _leftovers(tmp_path)


def test_refuses_non_empty_output_dir_and_missing_input(make_tiny_gguf, tmp_path):
    tiny = make_tiny_gguf()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        convert_gguf_to_hf(tiny.path, str(tmp_path / "hf"))
    assert os.listdir(tmp_path / "hf") == ["keep.txt"]
    with pytest.raises(FileNotFoundError):
        convert_gguf_to_hf(str(tmp_path / "nope.gguf"), str(tmp_path / "other"))


def test_name_mapping():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert (
        gguf_to_hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    )
    with pytest.raises(ValueError, match="unsupported GGUF tensor"):
        gguf_to_hf_name("blk.0.ffn_gate_exps.weight")
