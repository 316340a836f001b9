"""Which attention backend serves a model by default: resolved at parse time, so it
lives with the configuration, below the layers that implement the backends."""

from __future__ import annotations

FLASHINFER_HEAD_DIMS = (64, 128, 256)  # the head dims flashinfer has kernels for


def default_attention_backend(
    device: str, dtype: str, head_dim: int | None = None, whole_steps: bool = False
) -> str:
    """flashinfer on CUDA when importable and it has kernels for the model (16-bit
    dtypes; head dims 64/128/256), else triton on CUDA, else torch_ref.
    whole_steps: every step of the model runs through graphs and is launch-bound there
    (`config/piecewise.py`); then triton, whose graphs take a whole step (a prompt beside
    the decoding rows) where flashinfer's take it in pieces, one eager attention a layer.
    NOTE: measured on nvidia-h200 (benchmarks/NOTES.md, stop 56), SmolLM2 over two machines
    and ten servers: output on par or better (+15% / +19% at 16 / 256 streams on one
    machine, +2% / +1.5% on the other; 64 streams within +-3%), first tokens at 1-16
    streams 16-42% sooner."""
    if not device.startswith("cuda"):
        return "torch_ref"
    if whole_steps:
        return "triton"
    import importlib.util

    fits = dtype != "float32" and (head_dim is None or head_dim in FLASHINFER_HEAD_DIMS)
    if fits and importlib.util.find_spec("flashinfer") is not None:
        return "flashinfer"
    return "triton"
