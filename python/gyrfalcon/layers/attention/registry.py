"""Build attention backends by name; imports are lazy so CPU never imports GPU code."""

from __future__ import annotations

from gyrfalcon.layers.attention.base import AttentionBackend


def create_backend(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
) -> AttentionBackend:
    if name == "torch_ref":
        from gyrfalcon.layers.attention.torch_ref import TorchRefBackend

        return TorchRefBackend(num_heads, num_kv_heads, head_dim, scale)
    raise ValueError(f"unknown attention backend {name!r} (available: torch_ref)")
