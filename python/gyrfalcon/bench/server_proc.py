"""A `gyrfalcon serve` process for a benchmark: started in its own session, waited on
until /health answers, stopped on the way out (benchmarks/bench_spec.py,
benchmarks/lm_eval_compare.py); and its page accounting once it has drained."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def healthy(base_url: str) -> bool:
    """Whether base_url/health answers 200 now."""
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def running_server(
    cmd: list[str],
    port: int,
    log_path: Path,
    timeout: float,
    python_dir: Path | None = None,
    poll_s: float = 1.0,
    stop_timeout_s: float = 60.0,
) -> Iterator[str]:
    """Start cmd (its own session, output to log_path; python_dir first on PYTHONPATH:
    the gyrfalcon it imports), yield its URL once /health is 200, stop it with SIGTERM
    (SIGKILL to the group if it lingers) on the way out. RuntimeError if it exits or
    is not healthy within `timeout` seconds."""
    env = dict(os.environ)
    path = [str(python_dir) if python_dir else None, env.get("PYTHONPATH")]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, path))
    print("+", " ".join(cmd), f"> {log_path}", flush=True)
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while not healthy(base_url):
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"server exited with {proc.returncode}:\n{tail}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {timeout:.0f} s, see {log_path}")
            time.sleep(poll_s)
        yield base_url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(stop_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def pages_after(base_url: str, timeout: float = 60.0, poll_s: float = 0.5) -> dict[str, Any]:
    """The server's KV pages once nothing runs or waits (/server_info, polled up to
    `timeout` seconds): free and total pages over all ranks, its integrity check, and
    `ok`: drained, every page free and the check passed."""
    deadline = time.monotonic() + timeout
    while True:
        with urllib.request.urlopen(f"{base_url}/server_info", timeout=30) as response:
            info = json.load(response)
        drained = not info["num_running"] and not info["num_waiting"]
        if drained or time.monotonic() > deadline:
            break
        time.sleep(poll_s)
    free, total = info["num_free_pages"], info["num_total_pages"]
    ok = drained and free == total and bool(info["integrity_ok"])
    return {"free": free, "total": total, "integrity_ok": info["integrity_ok"], "ok": ok,
            "integrity_error": info.get("integrity_error")}  # fmt: skip
