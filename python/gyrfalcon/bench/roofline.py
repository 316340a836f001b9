"""Memory-bandwidth roofline of one decode step (pure arithmetic on a ModelConfig).

A decode step of a dense model reads every weight once (whatever the batch
size) plus, for each row, the K and V of every cached token in every layer.
At small batch sizes the step is bound by those bytes, so

    roofline step time = (weight bytes + KV bytes) / memory bandwidth

is the floor no engine can beat on that device; the measured step time over
this floor says how far an implementation is from it.
"""

from __future__ import annotations

from gyrfalcon.config.model_config import ModelConfig


def layer_param_count(cfg: ModelConfig) -> int:
    """Parameters of one decoder layer (attention, MLP and its two norms)."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    attn = cfg.attention_weights
    if cfg.qkv_bias:
        attn += q + 2 * kv
    if cfg.qk_norm:
        attn += 2 * cfg.head_dim
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size  # gate, up, down
    return attn + mlp + 2 * cfg.hidden_size


def param_count(cfg: ModelConfig) -> int:
    """Distinct parameters of the model; a tied embedding / LM head matrix counts once."""
    embed = cfg.vocab_size * cfg.hidden_size
    head = 0 if cfg.tie_word_embeddings else embed
    return embed + cfg.num_layers * layer_param_count(cfg) + cfg.hidden_size + head


def weight_bytes(cfg: ModelConfig, dtype_bytes: int, count_input_embedding: bool = True) -> int:
    """Weight bytes one decode step reads.

    Every distinct parameter is counted once, so a tied embedding / LM head
    matrix is counted once (as the LM head, which reads all of it). By default
    an untied input embedding table is counted in full too, which makes the
    figure the model's parameter bytes (Llama-3.1-8B: 8.03e9 params). A decode
    step only gathers one embedding row per token, so
    ``count_input_embedding=False`` drops an untied table for the strict figure
    (the tied matrix stays: the LM head still reads it).
    """
    params = param_count(cfg)
    if not count_input_embedding and not cfg.tie_word_embeddings:
        params -= cfg.vocab_size * cfg.hidden_size
    return params * dtype_bytes


def kv_read_bytes(cfg: ModelConfig, batch_size: int, context: int, dtype_bytes: int) -> int:
    """K and V bytes of every layer for every context token of every row."""
    return batch_size * context * cfg.kv_bytes_per_token(dtype_bytes)


def roofline_step_ms(weight_bytes: float, kv_bytes: float, bandwidth: float) -> float:
    """Lower bound on the step time in ms when reading the bytes at `bandwidth` B/s."""
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be positive, got {bandwidth}")
    return (weight_bytes + kv_bytes) / bandwidth * 1e3


def tokens_per_s(batch_size: int, step_ms: float) -> float:
    """Decode throughput: one token per row per step."""
    return batch_size / (step_ms / 1e3)
