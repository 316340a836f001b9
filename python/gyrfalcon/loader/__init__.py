"""Model loading: resolve a ``--model`` argument, convert GGUF files, stream HF weights."""

from gyrfalcon.loader.gguf_convert import convert_gguf_to_hf, permute_qk, unpermute_qk
from gyrfalcon.loader.hf_weights import iter_hf_weights
from gyrfalcon.loader.resolve import default_model_name, resolve_model

__all__ = [
    "convert_gguf_to_hf",
    "default_model_name",
    "iter_hf_weights",
    "permute_qk",
    "resolve_model",
    "unpermute_qk",
]
