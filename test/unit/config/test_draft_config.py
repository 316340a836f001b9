"""An EAGLE3 drafter's config.json, normalized once: its defaults, the aux-layer
convention (eagle_config ids name layer outputs, SGLang's reading; vLLM's top-level ids
name layer inputs), the round trip through to_hf, and the config-level checks
against a target."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import tiny_eagle3_config, tiny_target_config

from gyrfalcon.config.draft_config import DraftConfig, check_draft_config, default_aux_layers

TARGET = tiny_target_config(num_layers=8)


def drafter_hf(**overrides) -> dict:
    return tiny_eagle3_config(**{"max_position_embeddings": 2048, **overrides})


def test_defaults():
    hf = drafter_hf()
    del hf["draft_vocab_size"]
    cfg = DraftConfig.from_hf(hf)
    assert cfg.draft_vocab_size == cfg.vocab_size == 256
    assert cfg.target_hidden_size == cfg.hidden_size == 64
    assert cfg.layer.head_dim == 16 and not cfg.norm_before_residual
    assert cfg.aux_layer_ids(8) == default_aux_layers(8) == (2, 4, 5)
    assert cfg.aux_layer_ids(32) == (2, 16, 29)


def test_eagle_config_ids_name_layer_outputs():
    """SGLang's convention: id j is the output of layer j, the input of layer j + 1 (what
    forward_aux captures). SpecForge's default ids (1, N//2 - 1, N - 4) so land on the
    default inputs (2, N//2, N - 3)."""
    cfg = DraftConfig.from_hf(
        drafter_hf(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]})
    )
    assert cfg.eagle_aux_layer_ids == (1, 3, 4)
    assert cfg.aux_layer_ids(8) == (2, 4, 5) == default_aux_layers(8)
    last = DraftConfig.from_hf(
        drafter_hf(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 6]})
    )
    assert last.aux_layer_ids(8) == (1, 4, 7)
    with pytest.raises(ValueError, match="output of layer 7 .* inputs 0..7"):
        DraftConfig.from_hf(
            drafter_hf(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 7]})
        ).aux_layer_ids(8)


def test_vllm_top_level_ids_name_layer_inputs():
    cfg = DraftConfig.from_hf(drafter_hf(eagle_aux_hidden_state_layer_ids=[2, 4, 5]))
    assert cfg.aux_layer_ids(8) == (2, 4, 5)
    assert cfg.eagle_aux_layer_ids == (1, 3, 4)
    both = drafter_hf(
        eagle_aux_hidden_state_layer_ids=[2, 4, 5],
        eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 4]},
    )
    assert DraftConfig.from_hf(both).aux_layer_ids(8) == (2, 4, 5)
    both["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
    with pytest.raises(ValueError, match="name different target layers"):
        DraftConfig.from_hf(both)


@pytest.mark.parametrize(
    "overrides, error",
    [
        (dict(architectures=["LlamaForCausalLM"]), "architecture"),
        (dict(num_hidden_layers=2), "2 decoder layers"),
        (dict(eagle_config={"use_aux_hidden_state": False}), "without aux hidden states"),
        (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2]}), "reads 3"),
    ],
)
def test_unsupported_drafters_are_refused(overrides, error):
    with pytest.raises(ValueError, match=error):
        DraftConfig.from_hf(drafter_hf(**overrides))


def test_to_hf_round_trips():
    for hf in (
        drafter_hf(),
        drafter_hf(
            target_hidden_size=64,
            head_dim=32,
            norm_before_residual=True,
            eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3, 4]},
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            eos_token_id=[2, 3],
        ),
    ):
        cfg = DraftConfig.from_hf(hf)
        assert DraftConfig.from_hf(cfg.to_hf()) == cfg


def test_with_max_positions_only_grows():
    cfg = DraftConfig.from_hf(drafter_hf())
    assert cfg.with_max_positions(8192).layer.max_position_embeddings == 8192
    assert cfg.with_max_positions(512) == cfg


@pytest.mark.parametrize(
    "overrides, error",
    [
        (dict(vocab_size=300), "vocab_size 300 is not the target's 256"),
        (dict(draft_vocab_size=300, vocab_size=256), r"draft_vocab_size 300 is not in \[1"),
        (dict(target_hidden_size=128), "fc reads target hidden states of width 128"),
        (dict(hidden_size=128, target_hidden_size=64), "hidden_size 128 differs"),
        (dict(num_attention_heads=6, num_key_value_heads=4, head_dim=16), "do not group"),
        (dict(head_dim=15), "head_dim 15 is odd"),
        (dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 9]}), "layer 9"),
    ],
)
def test_check_draft_config(overrides, error):
    check_draft_config(TARGET, DraftConfig.from_hf(drafter_hf()))
    with pytest.raises(ValueError, match=error):
        check_draft_config(TARGET, DraftConfig.from_hf(drafter_hf(**overrides)))


def test_a_short_target_has_no_default_aux_layers():
    short = dataclasses.replace(TARGET, num_layers=2)
    with pytest.raises(ValueError, match="at least 3 target layers"):
        check_draft_config(short, DraftConfig.from_hf(drafter_hf()))
