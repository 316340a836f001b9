"""Build a model by family and load its weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.layers.context import LayerContext


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def model_class(cfg: ModelConfig) -> type[nn.Module]:
    if cfg.family == "llama":
        from gyrfalcon.models.llama import LlamaForCausalLM

        return LlamaForCausalLM
    raise ValueError(f"no model for family {cfg.family!r}")


def build_model(
    cfg: ModelConfig,
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    ctx: LayerContext,
    load_format: str = "auto",
    show_progress: bool = True,
) -> nn.Module:
    """Construct the model on `device` in `dtype`, its layers built with `ctx` (this
    rank's share of the weights, its kernel policy), and load its weights."""
    cls = model_class(cfg)
    # NOTE: rotary inv_freq is built explicitly in float32 and stays float32.
    with _default_dtype(dtype), torch.device(device):
        model = cls(cfg, ctx)
    if load_format == "dummy":
        gen = torch.Generator(device=device).manual_seed(0)
        for p in model.parameters():
            p.data.uniform_(-0.02, 0.02, generator=gen)
        for name, mod in model.named_modules():
            if name.endswith("norm"):
                mod.weight.data.fill_(1.0)
    else:
        from gyrfalcon.loader.hf_weights import iter_hf_weights

        model.load_weights(iter_hf_weights(model_dir, show_progress=show_progress))
    return model.eval()
