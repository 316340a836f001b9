"""The drafter being trained: its config for a target, its initial weights, export.

The drafter is the server's `LlamaForCausalLMEagle3`, built here in float32 (the
master weights; the forward runs in bfloat16 autocast on CUDA) on the target's
embedding module, which stays frozen. Its midlayer has the target's layer shape
(hidden size, heads, KV heads, head_dim, RoPE; the intermediate size unless
--draft-intermediate-size widens it) as a plain Llama layer (no qkv bias, no
qk-norm). The aux layers are the defaults, (2, N // 2, N - 3), written as no ids at
all (SGLang and vLLM agree on those), unless --aux-layer-ids names others.
"""

from __future__ import annotations

import dataclasses

import torch

from gyrfalcon.config.draft_config import DraftConfig
from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.kernels.dispatch import TORCH_REFERENCE
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.layers.embedding import VocabEmbedding
from gyrfalcon.models.llama_eagle3 import LlamaForCausalLMEagle3
from gyrfalcon.train.data import d2t_offsets

INIT_STD = 0.02  # HF Llama's initializer_range


def draft_config_for(
    target: ModelConfig,
    draft_vocab_size: int,
    dtype: str,
    intermediate_size: int | None = None,
    aux_layer_ids: tuple[int, ...] | None = None,
    norm_before_residual: bool = False,
) -> DraftConfig:
    """An EAGLE3 drafter of the target's layer shape over `draft_vocab_size` ids, its
    MLP `intermediate_size` wide (default: the target's); `dtype` is the config's
    torch_dtype (what the checkpoint holds); aux_layer_ids in eagle_config's
    convention (outputs of layers; None: the defaults, written as no ids); raises
    ValueError if the target has no such layer."""
    layer = dataclasses.replace(
        target,
        intermediate_size=intermediate_size or target.intermediate_size,
        architecture="LlamaForCausalLM",
        num_layers=1,
        tie_word_embeddings=False,
        qkv_bias=False,
        qk_norm=False,
        torch_dtype=dtype,
    )
    cfg = DraftConfig(
        layer=layer,
        draft_vocab_size=draft_vocab_size,
        target_hidden_size=target.hidden_size,
        eagle_aux_layer_ids=aux_layer_ids,
        norm_before_residual=norm_before_residual,
    )
    cfg.aux_layer_ids(target.num_layers)  # NOTE: raises if the target lacks a named layer
    return cfg


def build_drafter(
    cfg: DraftConfig,
    target: torch.nn.Module,
    draft_to_target: torch.Tensor,
    device: torch.device,
    seed: int,
) -> LlamaForCausalLMEagle3:
    """The drafter on `device` in float32 sharing target.embed_tokens, initialized
    (normal(0, INIT_STD) linears and LM head, unit norms) and trainable except for the
    embedding. draft_to_target: [draft_vocab] target ids (the vocabulary).

    NOTE: an LM head started as the target's rows at the draft ids (and the target's
    final norm) trained slower: held-out step-0 acceptance 0.28 vs 0.38 after 40 steps
    on SmolLM2 (CPU, 48 sequences)."""
    # NOTE: the training forward (`ttt`) reads the parameters itself; the reference
    # kernels only matter to the module's own forward (tests, evaluation by the engine)
    ctx = LayerContext(kernels=TORCH_REFERENCE)
    with torch.device(device):
        drafter = LlamaForCausalLMEagle3(cfg, ctx, target.embed_tokens)
    # NOTE: never .float() the module: that would convert the target's shared embedding
    assert drafter.fc.weight.dtype == torch.float32, "build under the float32 default dtype"
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, t in drafter.hf_state_dict().items():
        if name in ("d2t", "t2d"):
            continue
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(t.shape)
        else:
            tensors[name] = torch.randn(t.shape, generator=gen) * INIT_STD
    tensors["d2t"] = d2t_offsets(draft_to_target.cpu())
    drafter.load_weights(tensors.items())  # NOTE: the checks a checkpoint gets (d2t too)
    for name, p in drafter.named_parameters():
        p.requires_grad_(not name.startswith("embed_tokens."))
    return drafter


def trainable_parameters(drafter: LlamaForCausalLMEagle3) -> list[torch.nn.Parameter]:
    return [p for n, p in drafter.named_parameters() if not n.startswith("embed_tokens.")]


def export_drafter(drafter: LlamaForCausalLMEagle3, path: str, dtype: torch.dtype) -> None:
    """Save the drafter's weights in `dtype` (`save_pretrained`: the format SGLang and
    vLLM load), through a CPU copy: the trained module stays as it is."""
    name = str(dtype).removeprefix("torch.")
    cfg = dataclasses.replace(
        drafter.cfg, layer=dataclasses.replace(drafter.cfg.layer, torch_dtype=name)
    )
    with torch.device("meta"):  # NOTE: never saved; only the constructor wants one
        embed = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, drafter.ctx)
    with torch.device("cpu"):
        copy = LlamaForCausalLMEagle3(cfg, drafter.ctx, embed)
    copy.load_weights((n, t.detach().cpu()) for n, t in drafter.hf_state_dict().items())
    copy.to(dtype).save_pretrained(path)
