"""The thread sampler that names a server's busy thread (gyrfalcon.bench.proc_cpu)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gyrfalcon.bench import proc_cpu as pc

STAT = "42 (a (b) c) S 7 42 42 0 -1 4194560 10 0 0 0 250 50 0 0 20 0 1 0 100"


def test_stat_fields_read_after_the_command_name() -> None:
    assert pc.cpu_seconds(STAT, 100) == pytest.approx(3.0)
    assert pc.stat_name(STAT) == "a (b) c"
    assert pc.stat_ppid(STAT) == 7
    mine = pc.cpu_seconds(Path("/proc/self/stat").read_text(), os.sysconf("SC_CLK_TCK"))
    times = os.times()
    assert abs(mine - (times.user + times.system)) < 0.05


def test_descendants_walk_the_whole_tree_and_nothing_else() -> None:
    parents = {1: 0, 10: 1, 11: 10, 12: 10, 13: 11, 20: 1, 21: 20}
    assert pc.descendants(10, parents) == [10, 11, 12, 13]
    assert pc.descendants(21, parents) == [21]
    assert pc.descendants(99, parents) == [99]


def test_thread_loads_share_of_a_core_per_interval() -> None:
    busy, idle, late = (1, 1), (1, 2), (1, 3)
    samples = [
        (0.0, {busy: ("srv", "loop", 5.0), idle: ("srv", "io", 1.0)}),
        (1.0, {busy: ("srv", "loop", 6.0), idle: ("srv", "io", 1.1)}),
        (2.0, {busy: ("srv", "loop", 6.5), idle: ("srv", "io", 1.2), late: ("w", "x", 0.0)}),
        (4.0, {busy: ("srv", "loop", 8.5), idle: ("srv", "io", 1.2), late: ("w", "x", 1.0)}),
    ]
    loads = pc.thread_loads(samples)
    assert [(x.tid, x.thread) for x in loads] == [(1, "loop"), (3, "x"), (2, "io")]
    loop, late_load, io = loads
    assert loop.cpu_s == 3.5 and loop.mean == pytest.approx(3.5 / 4)
    assert loop.max == 1.0 and loop.busy == pytest.approx(2 / 3, abs=1e-3)  # 1.0, 0.5, 1.0
    assert late_load.cpu_s == 1.0 and late_load.max == 0.5  # counted where it was seen
    assert io.max == pytest.approx(0.1) and io.busy == 0
    assert pc.thread_loads(samples[:1]) == []


def test_a_busy_server_child_and_the_command_itself_are_sampled(tmp_path: Path) -> None:
    spin = "import time\nt = time.time()\nwhile time.time() - t < {}: pass\n"
    child = subprocess.Popen([sys.executable, "-c", spin.format(30)])
    try:
        out = tmp_path / "cpu.json"
        rc = pc.main(
            [
                "--root",
                str(os.getpid()),
                "--interval",
                "0.2",
                "--output-json",
                str(out),
                "--",
                sys.executable,
                "-c",
                spin.format(1.5),
            ]
        )
    finally:
        child.kill()
        child.wait()
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["window_s"] >= 1.4
    busy = {x["pid"]: x for x in doc["threads"] if x["mean"] > 0.3}
    assert set(busy) == {child.pid, doc["command_pid"]}, doc
    assert busy[child.pid]["max"] > 0.6
