"""Start-up checks of an EAGLE3 drafter against its target (`validate_draft`): every way a
checkpoint can fail to serve the target is a ValueError saying what, before any weight
is copied."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from conftest import make_tiny_eagle3, tiny_target_config

from gyrfalcon.config.draft_config import DraftConfig
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.layers.embedding import VocabEmbedding
from gyrfalcon.loader.eagle3 import validate_draft
from gyrfalcon.models.llama_eagle3 import LlamaForCausalLMEagle3

TARGET = tiny_target_config(num_layers=8)
Tensors = dict[str, torch.Tensor]


@pytest.fixture
def drafter(tmp_path) -> Callable[..., tuple[DraftConfig, Tensors]]:
    """drafter(**config overrides): (its config, its checkpoint tensors)."""

    def make(**overrides) -> tuple[DraftConfig, Tensors]:
        path = str(tmp_path / f"eagle3-{len(list(tmp_path.iterdir()))}")
        tensors = make_tiny_eagle3(path, **overrides)
        return DraftConfig.from_dir(path), tensors

    return make


def test_a_good_pair_passes_as_tensors_or_as_a_model(drafter):
    cfg, tensors = drafter(embed_tokens=True)
    validate_draft(TARGET, cfg, tensors)
    validate_draft(TARGET, cfg, {f"model.{n}": t for n, t in tensors.items()})
    del tensors["t2d"]  # optional: d2t defines it
    validate_draft(TARGET, cfg, tensors)
    model = LlamaForCausalLMEagle3(cfg, LayerContext(), VocabEmbedding(256, 64, LayerContext()))
    model.load_weights(tensors.items())
    validate_draft(TARGET, cfg, model)


def with_d2t(tensors: Tensors, edit: Callable[[torch.Tensor], torch.Tensor]) -> Tensors:
    return dict(tensors, d2t=edit(tensors["d2t"].clone()))


def set_entry(d2t: torch.Tensor, i: int, value: int) -> torch.Tensor:
    d2t[i] = value
    return d2t


@pytest.mark.parametrize(
    "edit, error",
    [
        (lambda t: {n: x for n, x in t.items() if n != "d2t"}, "has no d2t"),
        (lambda t: with_d2t(t, lambda d: d[:-1]), r"d2t has shape \[31\]; draft_vocab_size is 32"),
        (lambda t: with_d2t(t, lambda d: d.float()), "integer offsets"),
        (lambda t: with_d2t(t, lambda d: set_entry(d, 31, 256 - 31)), "to target id 256, outside"),
        (lambda t: with_d2t(t, lambda d: set_entry(d, 0, -1)), "to target id -1, outside"),
        (
            lambda t: with_d2t(t, lambda d: set_entry(d, 1, int(d[0]) - 1)),
            r"draft ids \[0, 1\] both to target id .*: not one-to-one",
        ),
        (lambda t: dict(t, t2d=torch.ones(256, dtype=torch.bool)), "t2d marks target id"),
        (lambda t: dict(t, t2d=torch.zeros(256, dtype=torch.bool)), "which t2d does not mark"),
        (lambda t: dict(t, t2d=t["t2d"][:-1]), r"t2d has shape \[255\]"),
        (lambda t: {n: x for n, x in t.items() if n != "lm_head.weight"}, "lacks.*lm_head"),
        (lambda t: dict(t, **{"fc.bias": torch.zeros(64)}), "no EAGLE3 drafter has.*fc.bias"),
        (
            lambda t: dict(t, **{"fc.weight": torch.zeros(64, 3 * 128)}),
            r"fc.weight is \[64, 384\], the config says \[64, 192\]",
        ),
    ],
)
def test_a_bad_checkpoint_is_refused(drafter, edit, error):
    cfg, tensors = drafter()
    with pytest.raises(ValueError, match=error):
        validate_draft(TARGET, cfg, edit(tensors))


def test_attention_shapes_must_match_the_heads(drafter):
    """A config whose head_dim disagrees with the checkpoint's projections."""
    cfg, _ = drafter()
    _, wider = drafter(head_dim=32)
    with pytest.raises(ValueError, match=r"q_proj.weight is \[128, 128\].*head_dim 16"):
        validate_draft(TARGET, cfg, wider)


@pytest.mark.parametrize(
    "edit, error",
    [
        (lambda c: replace(c, layer=replace(c.layer, vocab_size=300)), "another tokenizer"),
        (lambda c: replace(c, target_hidden_size=128), "another target"),
        (lambda c: replace(c, draft_vocab_size=300), "draft_vocab_size 300"),
    ],
)
def test_config_mismatches_are_refused_first(drafter, edit, error):
    cfg, tensors = drafter()
    with pytest.raises(ValueError, match=error):
        validate_draft(TARGET, edit(cfg), tensors)
