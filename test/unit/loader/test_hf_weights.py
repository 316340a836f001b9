"""Tests for streaming the tensors of HF checkpoint directories."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from gyrfalcon.loader import hf_weights
from gyrfalcon.loader.hf_weights import count_hf_weights, iter_hf_weights


def _tiny_model(tie: bool = False) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _assert_same(loaded: list[tuple[str, torch.Tensor]], expected: dict[str, torch.Tensor]) -> None:
    names = [name for name, _ in loaded]
    assert len(names) == len(set(names)), "a tensor was yielded twice"
    assert set(names) == set(expected)
    for name, tensor in loaded:
        assert tensor.dtype == expected[name].dtype, name
        assert torch.equal(tensor, expected[name]), name


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    model = _tiny_model()
    out = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(out, max_shard_size="50KB")
    return str(out), model.state_dict()


def test_sharded_checkpoint_yields_exact_state_dict(sharded_dir) -> None:
    path, state = sharded_dir
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        shards = set(json.load(f)["weight_map"].values())
    assert len(shards) > 1, "fixture should produce a sharded checkpoint"
    assert not os.path.exists(os.path.join(path, "model.safetensors"))
    _assert_same(list(iter_hf_weights(path, show_progress=False)), state)
    assert count_hf_weights(path) == len(state)


def test_each_shard_opened_once(sharded_dir, monkeypatch) -> None:
    path, state = sharded_dir
    opened: list[str] = []
    real_open = hf_weights.safe_open

    def counting_open(filename, *args, **kwargs):
        opened.append(os.path.basename(filename))
        return real_open(filename, *args, **kwargs)

    monkeypatch.setattr(hf_weights, "safe_open", counting_open)
    assert len(list(iter_hf_weights(path, show_progress=False))) == len(state)
    shard_files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert sorted(opened) == shard_files


def test_single_file_checkpoint(tmp_path) -> None:
    model = _tiny_model(tie=True)
    model.save_pretrained(tmp_path)
    assert os.path.isfile(tmp_path / "model.safetensors")
    assert not os.path.exists(tmp_path / "model.safetensors.index.json")
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    _assert_same(list(iter_hf_weights(str(tmp_path), show_progress=False)), state)


def test_pytorch_bin_fallback(tmp_path) -> None:
    state = {"a.weight": torch.randn(3, 4), "b.bias": torch.arange(5, dtype=torch.int64)}
    torch.save(state, tmp_path / "pytorch_model.bin")
    _assert_same(list(iter_hf_weights(str(tmp_path), show_progress=False)), state)
    assert count_hf_weights(str(tmp_path)) is None


def test_safetensors_preferred_over_bin(tmp_path) -> None:
    model = _tiny_model(tie=True)
    model.save_pretrained(tmp_path)
    torch.save({"junk": torch.zeros(1)}, tmp_path / "pytorch_model.bin")
    names = {name for name, _ in iter_hf_weights(str(tmp_path), show_progress=False)}
    assert "junk" not in names and "model.embed_tokens.weight" in names


def test_progress_bar_shown_only_when_asked(sharded_dir, capfd) -> None:
    path, _ = sharded_dir
    list(iter_hf_weights(path, show_progress=True))
    assert "Loading weights" in capfd.readouterr().err
    list(iter_hf_weights(path, show_progress=False))
    assert "Loading weights" not in capfd.readouterr().err


def test_no_weights_is_a_clear_error(tmp_path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no weights found"):
        list(iter_hf_weights(str(tmp_path)))


def test_missing_shard_is_a_clear_error(tmp_path) -> None:
    index = {"weight_map": {"x.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00001-of-00002.safetensors"):
        list(iter_hf_weights(str(tmp_path), show_progress=False))


def test_index_naming_absent_tensor_raises(sharded_dir, tmp_path) -> None:
    path, _ = sharded_dir
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shard = next(iter(index["weight_map"].values()))
    os.symlink(os.path.join(path, shard), tmp_path / shard)
    index["weight_map"] = {"not.a.tensor": shard}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(KeyError, match="not.a.tensor"):
        list(iter_hf_weights(str(tmp_path), show_progress=False))
