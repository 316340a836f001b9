"""An ordered stop is quiet: SIGTERM or SIGINT to the whole process group (what
`kill -TERM -PGID`, systemd and Ctrl-C do) or SIGTERM to the launcher alone (what
docker stop does to PID 1) exits 0, logs no child death nor traceback, kills no child
for outliving its grace period, and leaves no process of the group behind. (A child
that really dies: test_lifecycle.py.)"""

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from server_util import STARTUP_TIMEOUT_S, Server, group_members, start_server, stop_server

from gyrfalcon.utils import free_port

NOISE = ("exited unexpectedly", "Exception ignored", "Traceback", "did not stop")
GROUP_GONE_TIMEOUT_S = 10


def assert_stopped_quietly(srv, code: int) -> None:
    log = srv.log()
    assert code == 0, log[-3000:]
    for noise in NOISE:
        assert noise not in log, log[-3000:]
    deadline = time.time() + GROUP_GONE_TIMEOUT_S
    while group_members(srv.proc.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not group_members(srv.proc.pid), "processes of the server's group outlived it"


def wait_exit(srv, timeout: float = 60) -> int:
    try:
        return srv.proc.wait(timeout)
    finally:
        stop_server(srv)  # NOTE: kills the group if the server did not stop in time


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["term", "int"])
def test_group_signal_drains_the_request_in_flight_and_exits_quietly(smollm2_dir, tmp_path, sig):
    srv = start_server(smollm2_dir, str(tmp_path / "log"), "--num-kv-pages", "64")
    model = httpx.get(f"{srv.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = dict(model=model, prompt="Once upon a time", max_tokens=24, ignore_eos=True, stream=True)
    with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=120) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        chunks = [next(lines)]  # the request is running
        os.killpg(srv.proc.pid, sig)
        chunks += list(lines)
    assert chunks[-1] == "data: [DONE]"
    last = json.loads(chunks[-2][len("data: ") :])
    assert last["choices"][0]["finish_reason"] == "length", chunks[-2]  # finished, no error
    assert_stopped_quietly(srv, wait_exit(srv))


def test_sigterm_to_the_launcher_alone_exits_quietly(smollm2_dir, tmp_path):
    srv = start_server(smollm2_dir, str(tmp_path / "log"), "--num-kv-pages", "64")
    assert_stopped_quietly(srv, stop_server(srv))


def test_group_sigterm_before_the_engine_is_ready_exits_quietly(smollm2_dir, tmp_path):
    log_path = str(tmp_path / "log")
    cmd = [sys.executable, "-m", "gyrfalcon.cli", "serve", smollm2_dir, "--port", str(free_port()),
           "--device", "cpu", "--dtype", "float32", "--num-kv-pages", "64"]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    srv = Server(proc, "", log_path)
    deadline = time.time() + STARTUP_TIMEOUT_S
    while "[scheduler]" not in srv.log() and time.time() < deadline:
        time.sleep(0.05)
    # NOTE: the children run (spawned first) while the launcher still imports its
    # frontend and the worker loads: the launcher's stop must take them down too
    assert "engine ready" not in srv.log() and "Uvicorn running" not in srv.log(), srv.log()
    os.killpg(proc.pid, signal.SIGTERM)
    assert_stopped_quietly(srv, wait_exit(srv))


def test_children_go_away_when_the_launcher_is_killed(smollm2_dir, tmp_path):
    srv = start_server(smollm2_dir, str(tmp_path / "log"), "--num-kv-pages", "64")
    os.kill(srv.proc.pid, signal.SIGKILL)  # no cleanup: PR_SET_PDEATHSIG must stop them
    srv.proc.wait(30)
    deadline = time.time() + GROUP_GONE_TIMEOUT_S
    while group_members(srv.proc.pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not group_members(srv.proc.pid), "children outlived a killed launcher"
