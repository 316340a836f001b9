"""benchmarks/bench_host_step.py: one short run of both halves, in a process of its own
(it freezes its heap, as a server process does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "bench_host_step.py"
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "python"))


def _run(tmp_path: Path, *flags: str) -> dict:
    out = tmp_path / "host.json"
    args = ["--rows", "4", "16", "--prompt-len", "40", "--steps", "6", "--repeats", "1"]
    subprocess.run(
        [sys.executable, str(SCRIPT), *args, "--output-json", str(out), *flags],
        check=True, env=ENV, capture_output=True, timeout=300,
    )  # fmt: skip
    return json.loads(out.read_text())


def test_reports_both_halves_per_row_for_each_row_count(tmp_path):
    report = _run(tmp_path)
    assert report["bench"] == "host_step" and report["gc"].startswith("frozen")
    assert [r["rows"] for r in report["runs"]] == [4, 16]
    for run in report["runs"]:
        assert run["scheduler_us_per_row"] > 0 and run["worker_us_per_row"] > 0, run
        per_row = run["scheduler_us_per_step"] / run["rows"]
        assert abs(per_row - run["scheduler_us_per_row"]) < 0.02, run
        assert run["cpu_forward_us_per_step"] > 0, "the model's forward was not subtracted"


def test_stock_collector_and_scheduler_only(tmp_path):
    report = _run(tmp_path, "--stock-gc", "--no-worker")
    assert report["gc"] == "stock"
    assert all("worker_us_per_row" not in r for r in report["runs"]), report["runs"]
