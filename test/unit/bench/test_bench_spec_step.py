"""benchmarks/bench_spec_step.py on the CPU: a tiny target and drafter's plain and spec
steps at two batch sizes, each engine's start-up heap frozen over its steps (as a served
worker's) and unfrozen after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from spec_util import make_pair

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "bench_spec_step.py"
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "python"))


def test_reports_plain_and_spec_steps_per_batch_size_with_the_heap_frozen(tmp_path):
    target, draft = make_pair(tmp_path)
    args = [
        target, draft, "--device", "cpu", "--attention-backend", "torch_ref",
        "--batch-sizes", "1,2", "--prompt-len", "12", "--steps", "10", "--num-steps", "2",
        "--device-kind", "cpu-test", "--output-dir", str(tmp_path / "out"),
    ]  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], check=True, env=ENV, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    report = json.loads((tmp_path / "out" / "spec_step_target_k2_cpu-test.json").read_text())
    assert report["frozen_heap"] and report["k"] == 2
    assert [r["batch_size"] for r in report["rows"]] == [1, 2]
    for r in report["rows"]:
        assert r["plain_step_ms"] > 0 and r["spec_step_ms"] > 0
        assert r["ratio"] == pytest.approx(r["spec_step_ms"] / r["plain_step_ms"], rel=1e-9)
        # a plain step emits one token a row (the steps in flight when the clock starts
        # and stops count too: within a step's worth over 10); a spec step at least one
        bs = r["batch_size"]
        assert bs <= r["plain_tokens_per_step"] <= 1.1 * bs + 1e-9
        assert r["spec_tokens_per_step"] >= bs
    # each engine's collections over its steps, counted with its heap frozen
    for name in ("plain", "spec"):
        assert f"{name} engine, steady steps: gc: " in done.stdout
