"""Build attention backends by name; imports are lazy so CPU never imports GPU code."""

from __future__ import annotations

from gyrfalcon.layers.attention.base import AttentionBackend


def default_attention_backend(device: str, dtype: str, head_dim: int | None = None) -> str:
    """flashinfer on CUDA when importable and it has kernels for the model (16-bit
    dtypes; head dims 64/128/256), else triton on CUDA, else torch_ref."""
    if not device.startswith("cuda"):
        return "torch_ref"
    import importlib.util

    from gyrfalcon.layers.attention.flashinfer_backend import FLASHINFER_HEAD_DIMS

    fits = dtype != "float32" and (head_dim is None or head_dim in FLASHINFER_HEAD_DIMS)
    if fits and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer"
    return "triton"


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
