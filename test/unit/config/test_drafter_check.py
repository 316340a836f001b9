"""An EAGLE3 drafter that cannot serve the target is refused when the flags are
resolved against the model's config (`config/resolve.py`), before any process starts
or any weight loads; `gyrfalcon serve` then exits 2 with the reason, not a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import make_tiny_eagle3, make_tiny_hf_model, tiny_target_config

from gyrfalcon.config.server_args import ServerArgs


def _spec_args(draft: str) -> ServerArgs:
    return ServerArgs(
        device="cpu", speculative_algorithm="EAGLE3", speculative_draft_model_path=draft
    )


@pytest.mark.parametrize(
    "layers, overrides, message",
    [
        (8, dict(vocab_size=128), "vocab_size 128 is not the target's 256"),
        (8, dict(target_hidden_size=32), "target hidden states of width 32"),
        (8, dict(hidden_size=32, num_attention_heads=2), "hidden_size 32 differs"),
        (2, {}, "EAGLE3 needs at least 3 target layers, not 2"),
        (8, dict(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 4, 8]}), "layer 8"),
    ],
)  # fmt: skip
def test_a_misfit_drafter_fails_when_the_flags_resolve(tmp_path, layers, overrides, message):
    draft = str(tmp_path / "draft")
    make_tiny_eagle3(draft, **overrides)
    with pytest.raises(ValueError, match=message):
        _spec_args(draft).resolved(tiny_target_config(layers))


def test_a_fitting_drafter_resolves_and_a_missing_one_does_not(tmp_path):
    draft = str(tmp_path / "draft")
    make_tiny_eagle3(draft)
    resolved = _spec_args(draft).resolved(tiny_target_config(8))
    assert (resolved.speculative_num_steps, resolved.speculative_num_draft_tokens) == (3, 4)
    with pytest.raises(ValueError, match="no config.json there"):
        _spec_args(str(tmp_path / "nothing")).resolved(tiny_target_config(8))


def test_serve_exits_2_with_the_reason(tmp_path):
    target, draft = str(tmp_path / "target"), str(tmp_path / "draft")
    make_tiny_hf_model(target, "llama", num_hidden_layers=4)
    make_tiny_eagle3(draft, vocab_size=128)
    cmd = [sys.executable, "-m", "gyrfalcon.cli", "serve", target, "--device", "cpu",
           "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("gyrfalcon serve: error: the drafter's vocab_size 128"), last
    assert "Traceback" not in done.stderr
