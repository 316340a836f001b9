"""Process lifecycle: health before ready, clean SIGTERM shutdown, a dying child."""

import os
import re
import signal
import time

import httpx
import pytest
from server_util import alive, children_of, start_server, stop_server

from gyrfalcon.frontend.engine_client import EngineClient
from gyrfalcon.frontend.server import create_app
from gyrfalcon.ipc.sockets import IpcPaths


def test_health_is_503_until_the_engine_is_ready(smollm2_dir):
    from fastapi.testclient import TestClient
    from transformers import AutoTokenizer

    paths, _ = IpcPaths.create()
    engine = EngineClient(paths)  # never started: no scheduler answers
    app = create_app(engine, AutoTokenizer.from_pretrained(smollm2_dir), "m")
    with TestClient(app) as tc:
        r = tc.get("/health")
        assert r.status_code == 503
        r = tc.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "x"}]},
        )
        assert r.status_code == 503 and r.json()["error"]["code"] == 503


def test_sigterm_stops_every_process(smollm2_dir, tmp_path):
    srv = start_server(smollm2_dir, str(tmp_path / "log"), "--num-kv-pages", "64")
    kids = children_of(srv.proc.pid)
    assert len(kids) >= 2, "expected scheduler and worker processes"
    assert stop_server(srv) == 0, srv.log()
    time.sleep(0.5)
    assert not [k for k in kids if alive(k)], "child processes outlived the server"


def test_profile_dirs_get_host_profiles_and_section_times_of_the_engine(
    smollm2_dir, tmp_path, monkeypatch
):
    """GYRFALCON_PROFILE_DIR: the scheduler and the worker write their cProfile stats
    when the server stops (docs/profiling: a served step's host time);
    GYRFALCON_SECTION_TIMES: the worker writes its step sections' host time per plan."""
    monkeypatch.setenv("GYRFALCON_PROFILE_DIR", str(tmp_path / "prof"))
    monkeypatch.setenv("GYRFALCON_SECTION_TIMES", str(tmp_path / "sections"))
    log = str(tmp_path / "log")
    srv = start_server(smollm2_dir, log, "--num-kv-pages", "64", "--served-model-name", "m")
    body = {"model": "m", "prompt": "Hello", "max_tokens": 3}
    assert httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=60).status_code == 200
    assert stop_server(srv) == 0, srv.log()
    assert sorted(os.listdir(tmp_path / "prof")) == ["scheduler.txt", "worker0.txt"]
    worker = (tmp_path / "prof" / "worker0.txt").read_text()
    assert "host profile of worker0" in worker and "submit_batch" in worker
    assert "build_plan" in (tmp_path / "prof" / "scheduler.txt").read_text()
    (name,) = os.listdir(tmp_path / "sections")
    assert re.fullmatch(r"sections_worker0_\d+\.md", name)
    table = (tmp_path / "sections" / name).read_text()
    plans = int(re.search(r": (\d+) plans", table).group(1))
    launches = int(re.search(r"\| worker launch \(all steps\) \| (\d+) \|", table).group(1))
    assert 3 <= launches <= plans  # NOTE: a plan that only ends requests launches nothing


def test_ctrl_c_stops_every_process(smollm2_dir, tmp_path):
    srv = start_server(smollm2_dir, str(tmp_path / "log"), "--num-kv-pages", "64")
    kids = children_of(srv.proc.pid)
    os.killpg(srv.proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
    try:
        code = srv.proc.wait(30)
    finally:
        stop_server(srv)
    assert code == 0, srv.log()[-3000:]
    time.sleep(0.5)
    assert not [k for k in kids if alive(k)], "child processes outlived the server"


def comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


@pytest.mark.parametrize("victim", ["gyr-worker0", "gyr-scheduler"])
def test_a_child_killed_under_load_ends_requests_and_the_server(smollm2_dir, tmp_path, victim):
    """SIGKILL the worker or the scheduler while a stream runs: the client gets an
    error (an error event, or the connection ends) instead of hanging, the server
    exits non-zero within 30 s and leaves no child behind."""
    srv = start_server(smollm2_dir, str(tmp_path / "log"), "--num-kv-pages", "64")
    kids = children_of(srv.proc.pid)
    assert {"gyr-scheduler", "gyr-worker0"} <= {comm(k) for k in kids}  # named for ps/top
    (target,) = [k for k in kids if comm(k) == victim]
    model = httpx.get(f"{srv.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = dict(model=model, prompt="Once", max_tokens=900, ignore_eos=True, stream=True)
    lines: list[str] = []
    t0 = time.time()
    try:
        with httpx.stream("POST", f"{srv.base_url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 2:
                        os.kill(target, signal.SIGKILL)
    except httpx.HTTPError:
        pass  # NOTE: the connection may end with the server instead
    try:
        code = srv.proc.wait(30)
    finally:
        stop_server(srv)
    assert time.time() - t0 < 40
    assert code != 0
    assert lines[-1] != "data: [DONE]" or any('"error"' in x for x in lines), lines[-3:]
    log = srv.log()
    assert "exited unexpectedly" in log, log[-3000:]
    time.sleep(0.5)
    assert not [k for k in kids if alive(k)]
    try:
        httpx.get(f"{srv.base_url}/health", timeout=2)
        raise AssertionError("server still answers after a child died")
    except httpx.HTTPError:
        pass
