"""benchmarks/bench_arrival_step.py on the CPU: a tiny model's arrival steps run eagerly
without piecewise graphs and through them (static replay) within their size, each kind
of step reported with its token count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "bench_arrival_step.py"
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "python"))


def test_arrivals_run_eagerly_or_through_piecewise_graphs_by_size(tiny_model_dirs, tmp_path):
    out = tmp_path / "arrival.json"
    args = [
        "--model", tiny_model_dirs["llama"], "--device", "cpu", "--attention-backend",
        "torch_ref", "--rows", "4", "--prompt-len", "24", "--arrivals", "3",
        "--num-kv-pages", "200", "--piecewise-max-tokens", "0", "64", "--output-json", str(out),
    ]  # fmt: skip
    subprocess.run(
        [sys.executable, str(SCRIPT), *args], check=True, env=ENV, capture_output=True, timeout=300
    )
    report = json.loads(out.read_text())
    assert report["bench"] == "arrival_step" and report["rows"] == 4
    off, on = (r["kinds"] for r in report["runs"])
    # one prompt of 24 tokens beside the 4 decoding rows and the prompts before it
    assert off["eager"]["steps"] == 3 and off["eager"]["tokens_median"] == 24 + 4 + 1
    assert on["piecewise"]["steps"] == 3 and "eager" not in on
    assert off["graph"]["steps"] == on["graph"]["steps"] == 6  # the decodes between
    assert all(k["host_ms_median"] > 0 for k in (*off.values(), *on.values()))
