"""A `gyrfalcon serve` process for a benchmark: started in its own session, waited on
until /health answers, stopped on the way out (benchmarks/bench_spec.py,
benchmarks/lm_eval_compare.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path


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
