"""Model loading: resolve a ``--model`` argument, convert GGUF files, stream HF weights.

The names below load their module on first use: `resolve_model` (the launcher's, before
it spawns the ranks) imports no torch unless a GGUF file needs converting."""

import importlib

_HOMES = {
    "convert_gguf_to_hf": "gguf_convert",
    "permute_qk": "gguf_convert",
    "unpermute_qk": "gguf_convert",
    "iter_hf_weights": "hf_weights",
    "default_model_name": "resolve",
    "resolve_model": "resolve",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
