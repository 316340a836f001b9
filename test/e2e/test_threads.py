"""Thread counts of a live server: the frontend and the scheduler run torch on one
thread, the worker on --cpu-threads (default: the cores it may run on), and the
children start with OpenMP's busy-wait off."""

import os
import re

from server_util import start_server, stop_server

from gyrfalcon.config.cli_args import available_cores

THREADS_LINE = re.compile(r"\[(\w+)\] INFO gyrfalcon\.utils: torch threads: (\d+)(.*)")


def children_of(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(k) for k in f.read().split()]


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = f.read().decode(errors="replace").split("\0")
    return dict(item.split("=", 1) for item in items if "=" in item)


def test_each_process_runs_torch_on_its_thread_count(smollm2_dir, tmp_path):
    srv = start_server(smollm2_dir, str(tmp_path / "log"), "--num-kv-pages", "64")
    try:
        kids = children_of(srv.proc.pid)
        envs = [environ(k) for k in kids]
    finally:
        assert stop_server(srv) == 0, srv.log()[-3000:]
    found = {m[1]: (int(m[2]), m[3]) for m in THREADS_LINE.finditer(srv.log())}
    assert found["main"] == (1, " (inter-op 1)"), found
    assert found["scheduler"][0] == 1, found  # torch is not even loaded there
    assert found["worker0"] == (available_cores(), " (inter-op 1)"), found
    assert len(envs) >= 2, "expected scheduler and worker processes"
    for env in envs:  # NOTE: read by the OpenMP runtime when it loads, so set at spawn
        assert env["OMP_WAIT_POLICY"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
        assert env["KMP_BLOCKTIME"] == os.environ.get("KMP_BLOCKTIME", "0")
