"""Build a model by family (or an EAGLE3 drafter for a target) and load its weights."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from gyrfalcon.config.draft_config import DraftConfig
from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.layers.embedding import VocabEmbedding


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
    if cfg.family == "moe":
        from gyrfalcon.models.moe import MoeForCausalLM

        return MoeForCausalLM
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
        _fill_dummy(model, device)
    else:
        from gyrfalcon.loader.hf_weights import iter_hf_weights

        # NOTE: a model may skip tensors it has no share of (another EP rank's experts)
        keep = getattr(model, "keeps_weight", None)
        model.load_weights(iter_hf_weights(model_dir, show_progress=show_progress, keep=keep))
    return model.eval()


def build_draft_model(
    cfg: DraftConfig,
    target: ModelConfig,
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    ctx: LayerContext,
    embed_tokens: VocabEmbedding,
    load_format: str = "auto",
    show_progress: bool = True,
) -> nn.Module:
    """The EAGLE3 drafter of `target`, sharing its embedding module `embed_tokens`.
    The pair is checked (`validate_draft`: configs, d2t/t2d, every tensor's shape)
    before any weight is copied; ValueError says what does not fit. A dummy drafter
    maps draft id i to target id i."""
    from gyrfalcon.config.draft_config import check_draft_config
    from gyrfalcon.models.llama_eagle3 import LlamaForCausalLMEagle3

    check_draft_config(target, cfg)
    tensors = None
    if load_format != "dummy":
        from gyrfalcon.loader.eagle3 import validate_draft
        from gyrfalcon.loader.hf_weights import iter_hf_weights

        tensors = dict(iter_hf_weights(model_dir, show_progress=show_progress))
        validate_draft(target, cfg, tensors)
    # NOTE: rotary tables for the target's context, whatever the drafter's config says
    built = cfg.with_max_positions(target.max_position_embeddings)
    with _default_dtype(dtype), torch.device(device):
        model = LlamaForCausalLMEagle3(built, ctx, embed_tokens)
    if tensors is None:
        _fill_dummy(model, device, skip="embed_tokens.")  # NOTE: the target's, not ours
    else:
        model.load_weights(tensors.items())
    return model.eval()


def _fill_dummy(model: nn.Module, device: torch.device, skip: str | None = None) -> None:
    """Small uniform weights (fixed seed), norms at one; parameters under `skip` kept."""
    gen = torch.Generator(device=device).manual_seed(0)
    for name, p in model.named_parameters():
        if skip is None or not name.startswith(skip):
            p.data.uniform_(-0.02, 0.02, generator=gen)
    for name, mod in model.named_modules():
        if name.endswith("norm"):
            mod.weight.data.fill_(1.0)
