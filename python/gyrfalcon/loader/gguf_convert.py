"""Convert a llama- or qwen2-architecture GGUF file into a Hugging Face directory.

The output holds ``config.json``, ``generation_config.json``, float32 weights in
``model.safetensors`` (or shards plus an index for very large models), the
tokenizer files and a ``gyrfalcon_gguf.json`` marker that records the source.
Everything is written to a temporary directory beside ``out_dir`` and renamed
into place at the end, so an interrupted conversion leaves no partial output.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import tempfile
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from gyrfalcon.loader.gguf_marker import CONVERTER_VERSION, MARKER_FILE

DEFAULT_MAX_SHARD_BYTES = 4 * 1024**3

# GGUF architecture -> (HF architecture, HF model_type, q/k rows permuted by llama.cpp)
_ARCHS: dict[str, tuple[str, str, bool]] = {
    "llama": ("LlamaForCausalLM", "llama", True),
    "qwen2": ("Qwen2ForCausalLM", "qwen2", False),
}
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|end|>")
_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_MISSING = object()


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder HF (rotate-half) q/k projection rows into llama.cpp's interleaved layout.

    Within each head, HF rows ``i`` and ``i + head_dim/2`` form a rotary pair;
    afterwards they sit at rows ``2*i`` and ``2*i + 1``. Works on weights
    ``[n_head*head_dim, in]`` and biases ``[n_head*head_dim]``.
    """
    rows = w.shape[0]
    if rows % n_head or (rows // n_head) % 2:
        raise ValueError(f"cannot split {rows} rows into {n_head} heads of even size")
    half = rows // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of :func:`permute_qk`: GGUF interleaved q/k rows back to HF rotate-half order."""
    rows = w.shape[0]
    if rows % n_head or (rows // n_head) % 2:
        raise ValueError(f"cannot split {rows} rows into {n_head} heads of even size")
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def gguf_to_hf_name(name: str) -> str:
    """Map a GGUF tensor name (e.g. ``blk.3.attn_q.weight``) to its HF name."""
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    base, _, kind = name.rpartition(".")
    if base in _TOP_LEVEL_NAMES and kind in ("weight", "bias"):
        return f"{_TOP_LEVEL_NAMES[base]}.{kind}"
    raise ValueError(f"unsupported GGUF tensor {name!r}")


def _field(reader: GGUFReader, key: str, default: Any = _MISSING) -> Any:
    """Return a metadata value of the GGUF file, or ``default`` when absent."""
    field = reader.fields.get(key)
    if field is None:
        if default is _MISSING:
            raise ValueError(f"GGUF file lacks required metadata {key!r}")
        return default
    return field.contents()


def _llama3_factors(theta: float, head_dim: int, params: dict[str, Any]) -> np.ndarray:
    """Per-frequency divisors that llama3 rope scaling applies to the default frequencies."""
    inv_freq = theta ** -(np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    orig = params["original_max_position_embeddings"]
    low, high, factor = params["low_freq_factor"], params["high_freq_factor"], params["factor"]
    smooth = (orig / wavelen - low) / (high - low)
    medium = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelen < orig / high, 1.0, np.where(wavelen > orig / low, factor, medium))


def _rope_scaling(reader: GGUFReader, arch: str, theta: float, head_dim: int) -> dict | None:
    """HF ``rope_scaling`` from GGUF metadata and an optional ``rope_freqs`` tensor."""
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        factors = np.asarray(dequantize(freqs.data, freqs.tensor_type), np.float64).ravel()
        params = {
            "rope_type": "llama3",
            "factor": float(factors.max()),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        }
        expected = _llama3_factors(theta, head_dim, params)
        if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-3):
            raise ValueError("GGUF rope_freqs do not match llama3 rope scaling; unsupported")
        return params
    kind = _field(reader, f"{arch}.rope.scaling.type", "none")
    if kind in ("none", ""):
        return None
    if kind == "linear":
        return {
            "rope_type": "linear",
            "factor": float(_field(reader, f"{arch}.rope.scaling.factor")),
        }
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")


def build_hf_config(reader: GGUFReader) -> dict[str, Any]:
    """Build an HF ``config.json`` dictionary from the metadata of an opened GGUF file."""
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHS:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(sorted(_ARCHS))}"
        )
    hf_arch, model_type, _ = _ARCHS[arch]
    names = {t.name for t in reader.tensors}
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    n_head = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // n_head))
    rope_dim = int(_field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embeddings ({rope_dim} of {head_dim}) are unsupported")
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    vocab = int(embd.shape[-1])
    theta = float(_field(reader, f"{arch}.rope.freq_base", 10000.0))
    # GGUF stores float32: keep the shortest decimal that round-trips (1e-05, not 9.99e-06)
    eps = float(str(np.float32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6))))
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", n_head)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 4096)),
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(reader, arch, theta, head_dim),
        "tie_word_embeddings": "output.weight" not in names,
        "torch_dtype": "float32",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id", None),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id", None),
        "use_cache": True,
    }
    if model_type == "llama":
        biases = {f"blk.0.{p}.bias" in names for p in ("attn_q", "attn_k", "attn_v", "attn_output")}
        if len(biases) > 1:
            raise ValueError("llama GGUF with biases on only some attention projections")
        config["attention_bias"] = biases.pop()
        config["mlp_bias"] = False
    return config


def _shard_plan(reader: GGUFReader, max_shard_bytes: int) -> list[list[Any]]:
    """Group the GGUF tensors to convert into shards of at most ``max_shard_bytes`` float32."""
    shards: list[list[Any]] = [[]]
    used = 0
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        size = int(np.prod([int(d) for d in t.shape])) * 4
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(t)
        used += size
    return shards


def _dequantized(tensor: Any, config: dict[str, Any], permuted: bool) -> torch.Tensor:
    """Dequantize one GGUF tensor to float32 in HF shape and row order."""
    shape = tuple(int(d) for d in reversed(tensor.shape))
    arr = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
    out = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
    if permuted:
        if ".attn_q." in tensor.name:
            out = unpermute_qk(out, config["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            out = unpermute_qk(out, config["num_key_value_heads"])
    return out.contiguous()


def _write_weights(
    reader: GGUFReader, config: dict[str, Any], permuted: bool, out: str, max_shard_bytes: int
) -> None:
    """Dequantize every tensor and save it as float32 safetensors (sharded if large)."""
    shards = _shard_plan(reader, max_shard_bytes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        tensors = {gguf_to_hf_name(t.name): _dequantized(t, config, permuted) for t in shard}
        save_file(tensors, os.path.join(out, fname), metadata={"format": "pt"})
        for name, value in tensors.items():
            weight_map[name] = fname
            total += value.numel() * value.element_size()
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        with open(os.path.join(out, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)


def _write_tokenizer(gguf_path: str, reader: GGUFReader, out: str) -> dict[str, Any]:
    """Save the GGUF's tokenizer into ``out``; return the generation config it implies."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path)
    )
    tok.save_pretrained(out)
    vocab = tok.get_vocab()
    template = tok.chat_template if isinstance(tok.chat_template, str) else ""
    candidates = [tok.eos_token_id]
    candidates += [vocab[t] for t in _END_OF_TURN_TOKENS if t in vocab and t in template]
    candidates += [_field(reader, "tokenizer.ggml.eot_token_id", None)]
    candidates += [_field(reader, "tokenizer.ggml.eos_token_id", None)]
    eos = list(dict.fromkeys(int(c) for c in candidates if c is not None))
    gen: dict[str, Any] = {"eos_token_id": eos}
    bos = _field(reader, "tokenizer.ggml.bos_token_id", None)
    if bos is not None:
        gen["bos_token_id"] = int(bos)
    pad = _field(reader, "tokenizer.ggml.padding_token_id", None)
    if pad is not None:
        gen["pad_token_id"] = int(pad)
    return gen


def _dump_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` as indented JSON."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


def convert_gguf_to_hf(
    gguf_path: str, out_dir: str, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> str:
    """Convert the GGUF file ``gguf_path`` into an HF checkpoint directory ``out_dir``.

    Returns the absolute path of ``out_dir``. Raises ``FileExistsError`` when
    ``out_dir`` already exists and is not empty, ``FileNotFoundError`` for a
    missing input and ``ValueError`` for an unsupported architecture or layout.
    """
    gguf_path = os.path.abspath(gguf_path)
    out_dir = os.path.abspath(out_dir)
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"output directory already exists and is not empty: {out_dir}")
    reader = GGUFReader(gguf_path)
    config = build_hf_config(reader)
    permuted = _ARCHS[_field(reader, "general.architecture")][2]
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", suffix=".tmp", dir=parent)
    try:
        os.chmod(tmp, 0o755)
        _write_weights(reader, config, permuted, tmp, max_shard_bytes)
        gen = _write_tokenizer(gguf_path, reader, tmp)
        _dump_json(os.path.join(tmp, "config.json"), config)
        _dump_json(os.path.join(tmp, "generation_config.json"), gen)
        stat = os.stat(gguf_path)
        marker = {
            "converter_version": CONVERTER_VERSION,
            "source": gguf_path,
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
        }
        _dump_json(os.path.join(tmp, MARKER_FILE), marker)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            # Another process finished the same conversion first: keep its result.
            if not os.path.isfile(os.path.join(out_dir, MARKER_FILE)):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
