"""Start and stop a live `gyrfalcon serve` for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from gyrfalcon.utils import free_port

STARTUP_TIMEOUT_S = 240
DRAIN_TIMEOUT_S = 30


@dataclass
class Server:
    proc: subprocess.Popen
    base_url: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def info(self) -> dict:
        return httpx.get(f"{self.base_url}/server_info", timeout=30).json()


def serve_command(model_dir: str, port: int, *extra: str) -> list[str]:
    """`gyrfalcon serve` on the CPU in float32, HTTP on `port`, invariants checked."""
    return [
        sys.executable,
        "-m",
        "gyrfalcon.cli",
        "serve",
        model_dir,
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--check-invariants",
        *extra,
    ]


def spawn_serve(cmd: list[str], log_path: str) -> subprocess.Popen:
    """Run cmd in its own session (process group), output to log_path."""
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def start_server(model_dir: str, log_path: str, *extra: str) -> Server:
    port = free_port()
    proc = spawn_serve(serve_command(model_dir, port, *extra), log_path)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.time() + STARTUP_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop_server(server)
    raise RuntimeError(f"server did not become healthy:\n{server.log()}")


def stop_server(server: Server, timeout: float = 30) -> int:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(server.proc.pid, signal.SIGKILL)
            server.proc.wait()
    return server.proc.returncode


def wait_drained(server: Server) -> dict:
    """Wait until nothing runs; return the final /server_info."""
    deadline = time.time() + DRAIN_TIMEOUT_S
    info = server.info()
    while time.time() < deadline and (info["num_running"] or info["num_waiting"]):
        time.sleep(0.2)
        info = server.info()
    return info


def proc_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/<pid>/stat after the command name) of every process:
    state, parent pid, process group, ..."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        yield int(entry), fields


def children_of(pid: int) -> list[int]:
    return [child for child, fields in proc_stats() if int(fields[1]) == pid]


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`."""
    return [p for p, fields in proc_stats() if int(fields[2]) == pgid and fields[0] != "Z"]


def rss_kb(pid: int) -> int:
    """Resident memory of a process, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def worker_pids(server: Server, n: int) -> list[int]:
    """The server's n worker ranks, in start order: of its live children, the n holding
    the most memory (the model's shards; the scheduler never loads torch)."""
    kids = [k for k in children_of(server.proc.pid) if alive(k)]
    return sorted(sorted(kids, key=rss_kb)[-n:])


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@dataclass
class Served:
    """What `serve_greedy` got: per prompt (tokens, logprobs) (both empty without
    logprobs), per prompt its text, the server's page accounting after them (with the
    response's usage), and its log."""

    out: list[tuple[list[str], list[float]]]
    info: dict
    log: str
    texts: list[str]


def serve_greedy(
    model_dir: str,
    log_path: str,
    prompts: list,
    max_tokens: int,
    *flags: str,
    logprobs: bool = True,
) -> Served:
    """Start a server with `flags` (served as model "m"), send the prompts as one greedy
    completions request (EOS ignored, logprobs 1 unless `logprobs` is off), wait until
    every page is back, stop."""
    srv = start_server(model_dir, log_path, "--served-model-name", "m", *flags)
    try:
        body = {
            "model": "m", "prompt": prompts, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **({"logprobs": 1} if logprobs else {}),
        }  # fmt: skip
        r = httpx.post(f"{srv.base_url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        out = [
            (c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"]) if logprobs else ([], [])
            for c in choices
        ]
        info = {**wait_drained(srv), "usage": r.json()["usage"]}
    finally:
        assert stop_server(srv) == 0, srv.log()[-3000:]
    return Served(out, info, srv.log(), [c["text"] for c in choices])


def graph_forwards(log: str, rank: int) -> int:
    """The target forwards rank `rank` replayed through graphs, from the count its
    worker logs when it stops (0 if it logged none)."""
    import re

    found = re.search(rf"rank {rank}: \d+ steps, (\d+) target forwards through graphs", log)
    return int(found[1]) if found else 0


def step_kinds(log: str, rank: int) -> dict[str, int]:
    """Steps per kind (fused, graph, piecewise, eager, idle) that rank `rank`'s worker
    logged when it stopped (worker/step_stats.py); {} if it logged none."""
    import re

    line = re.search(rf"rank {rank}: \d+ steps, .*", log)
    if line is None:
        return {}
    return {k: int(n) for k, n in re.findall(r"(\w+) (\d+) x [\d.]+ ms host", line[0])}


def kill_a_rank_mid_load(server: Server, num_ranks: int, body: dict, wait_s: float) -> tuple:
    """Send `body` (a completions request) from a thread, wait until the server runs it,
    SIGKILL its last worker rank and wait up to wait_s for the server to exit: (its exit
    code, or None if it did not, the seconds it took, the children it had)."""
    import threading

    kids = children_of(server.proc.pid)

    def load() -> None:
        try:
            httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
        except httpx.HTTPError:
            pass  # NOTE: the server dies under it

    threading.Thread(target=load, daemon=True).start()
    deadline = time.monotonic() + 60
    while server.info()["num_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.info()["num_running"] > 0, "the request never started"
    os.kill(worker_pids(server, num_ranks)[-1], signal.SIGKILL)
    start = time.monotonic()
    try:
        code = server.proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        code = None
    return code, time.monotonic() - start, kids


def sse_events(body: str) -> list[Any]:
    """The JSON payloads of an SSE body, checking it ends with [DONE]."""
    events = [line[len("data: ") :] for line in body.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", "a stream must end with [DONE]"
    return [json.loads(e) for e in events[:-1]]
