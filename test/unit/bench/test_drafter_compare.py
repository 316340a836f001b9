"""The paired comparison of two drafters' acceptance in rounds: ratios of sums, a
bootstrap interval that holds 0 for drafters the prompts cannot tell apart and
excludes it for one better on every prompt, and refusals for unpaired inputs."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from gyrfalcon.bench.drafter_compare import in_rounds, paired_difference


def test_in_rounds_is_tokens_over_verify_steps_over_all_prompts():
    rounds = [(10, 25), (5, 5), (20, 60)]
    assert in_rounds(rounds) == pytest.approx(90 / 35)
    assert in_rounds(rounds, [2, 2]) == pytest.approx(3.0)


def test_a_drafter_better_on_every_prompt_has_an_interval_above_zero():
    rng = random.Random(1)
    tokens = [rng.randint(100, 300) for _ in range(40)]
    a = [(round(t / 2.4), t) for t in tokens]  # ~2.4 tokens a step
    b = [(round(t / 2.6), t) for t in tokens]  # ~2.6 on each prompt
    d = paired_difference(a, b, resamples=2000)
    assert d.delta == pytest.approx(in_rounds(b) - in_rounds(a))
    assert 0 < d.low <= d.delta <= d.high


def test_drafters_that_trade_prompts_have_an_interval_holding_zero():
    rng = random.Random(2)
    tokens = [rng.randint(100, 300) for _ in range(40)]
    # the same per-prompt lengths, shuffled between the prompts: no drafter is better
    lengths = [2.0 + 0.02 * i for i in range(40)]
    a = [(round(t / x), t) for t, x in zip(tokens, lengths)]
    shuffled = lengths[:]
    rng.shuffle(shuffled)
    b = [(round(t / x), t) for t, x in zip(tokens, shuffled)]
    d = paired_difference(a, b, resamples=2000)
    assert d.low < 0 < d.high


def test_unpaired_inputs_are_refused():
    with pytest.raises(ValueError, match="not the same prompts"):
        paired_difference([(1, 2)], [(1, 2), (1, 3)])
    with pytest.raises(ValueError, match="answers differ"):
        paired_difference([(1, 2), (1, 3)], [(1, 2), (1, 4)])


def test_the_script_names_rows_by_name_equals_path(tmp_path):
    """`compare_drafters.py NAME=PATH`: the row carries NAME (several runs' JSONs share a
    file name); a plain path keeps the file's name."""
    script = Path(__file__).resolve().parents[3] / "benchmarks" / "compare_drafters.py"
    for name, steps in (("base.json", 100), ("eval.json", 90)):
        (tmp_path / name).write_text(json.dumps({"rounds_per_sequence": [[steps, 250]] * 4}))
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "base.json"),
         f"lr 2e-3={tmp_path / 'eval.json'}", "--resamples", "50"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    rows = [line for line in out.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1].startswith("| base.json | 2.500 |")
    assert rows[2].startswith("| lr 2e-3 | 2.778 | +0.278 |")
