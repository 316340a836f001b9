"""Build attention backends by name; imports are lazy so CPU never imports GPU code."""

from __future__ import annotations

from gyrfalcon.layers.attention.base import AttentionBackend


def create_backend(
    name: str, num_heads: int, num_kv_heads: int, head_dim: int, scale: float
) -> AttentionBackend:
    if name == "torch_ref":
        from gyrfalcon.layers.attention.torch_ref import TorchRefBackend

        return TorchRefBackend(num_heads, num_kv_heads, head_dim, scale)
    if name == "triton":
        from gyrfalcon.layers.attention.triton_backend import TritonBackend

        return TritonBackend(num_heads, num_kv_heads, head_dim, scale)
    if name == "flashinfer":
        from gyrfalcon.layers.attention.flashinfer_backend import FlashInferBackend

        return FlashInferBackend(num_heads, num_kv_heads, head_dim, scale)
    raise ValueError(
        f"unknown attention backend {name!r} (available: torch_ref, triton, flashinfer)"
    )
