"""Child-process start-up helpers: who may stop a child, OpenMP environment, threads."""

import ctypes
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import pytest

from gyrfalcon import utils
from gyrfalcon.utils import CHILD_OPENMP_ENV, ChildStop, set_child_openmp_env


def sigterm(stop: ChildStop) -> None:
    stop.on_sigterm(signal.SIGTERM, None)


def test_group_sigterm_is_left_to_the_launcher():
    stop = ChildStop(ctypes.c_bool(False))
    sigterm(stop)  # kill -TERM -PGID, systemd: the launcher drains HTTP first
    assert not stop.requested
    stop.serving()
    sigterm(stop)
    assert not stop.requested


def test_launcher_stop_while_starting_exits_at_once_and_only_once():
    stopping = ctypes.c_bool(False)
    stop = ChildStop(stopping)
    stopping.value = True  # the launcher sets the flag, then SIGTERMs us
    with pytest.raises(SystemExit) as exc:
        sigterm(stop)
    assert exc.value.code == 0 and stop.requested
    sigterm(stop)  # NOTE: a second SIGTERM (during atexit, say) must not raise again


def test_launcher_stop_while_serving_only_sets_requested():
    stop = ChildStop(ctypes.c_bool(True))
    stop.serving()
    sigterm(stop)  # no exception inside whatever the main loop was doing
    assert stop.requested


def test_parent_death_stops_the_child(monkeypatch):
    stop = ChildStop(ctypes.c_bool(False))
    stop.serving()
    monkeypatch.setattr(utils.os, "getppid", lambda: 1)  # reparented: PR_SET_PDEATHSIG fired
    assert stop.parent_gone()
    sigterm(stop)
    assert stop.requested


def test_child_openmp_env_keeps_the_users_choice(monkeypatch):
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    monkeypatch.delenv("KMP_BLOCKTIME", raising=False)
    set_child_openmp_env()
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"
    assert os.environ["KMP_BLOCKTIME"] == CHILD_OPENMP_ENV["KMP_BLOCKTIME"]
    monkeypatch.delenv("OMP_WAIT_POLICY")
    set_child_openmp_env()
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


def run_python(code: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_set_torch_threads_in_a_fresh_process():
    # a fresh interpreter: inter-op threads are settable only before any inter-op work
    got = run_python(
        "import torch; from gyrfalcon.utils import set_torch_threads; set_torch_threads(1); "
        "print(torch.get_num_threads(), torch.get_num_interop_threads())"
    )
    assert got == "1 1"


def test_set_torch_threads_before_torch_is_imported():
    # the scheduler never imports torch: a later import must still start on one thread
    got = run_python(
        "import sys; from gyrfalcon.utils import set_torch_threads; set_torch_threads(1); "
        "assert 'torch' not in sys.modules; import torch; print(torch.get_num_threads())"
    )
    assert got == "1"


def _ignores_sigterm(ready) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # NOTE: a child stuck in its teardown
    ready.set()
    while True:
        time.sleep(1)


def _obeys_sigterm(ready) -> None:
    ready.set()
    while True:
        time.sleep(1)


def test_stop_children_gives_late_children_one_grace_period_together(monkeypatch):
    """Three children that ignore SIGTERM are killed after one grace period, not one
    each (four GPU workers stuck in their teardown took 20 s to stop); a child that
    obeys SIGTERM ends by it, not by SIGKILL."""
    monkeypatch.setattr(utils, "CHILD_JOIN_TIMEOUT_S", 1.0)
    ctx = multiprocessing.get_context("fork")
    events = [ctx.Event() for _ in range(4)]
    targets = [_ignores_sigterm] * 3 + [_obeys_sigterm]
    procs = [ctx.Process(target=t, args=(e,), daemon=True) for t, e in zip(targets, events)]
    for p in procs:
        p.start()
    assert all(e.wait(30) for e in events)
    start = time.monotonic()
    utils.stop_children(procs)
    assert time.monotonic() - start < 2.5  # one second of grace, not three
    assert [p.exitcode for p in procs] == [-signal.SIGKILL] * 3 + [-signal.SIGTERM]


LEAK_SCRIPT = """
import ctypes, multiprocessing as mp, os
from gyrfalcon.utils import setup_child


def child(setup):
    if setup:
        setup_child("worker0", "WARNING", ctypes.c_bool(False))
    from tqdm.auto import tqdm
    for _ in tqdm(range(2), desc="Capturing CUDA graphs", disable=False):
        pass
    os._exit(0)  # as a worker leaves (worker/process.py)


if __name__ == "__main__":
    import sys
    p = mp.get_context("spawn").Process(target=child, args=(sys.argv[1] == "1",))
    p.start()
    p.join()
    assert p.exitcode == 0
"""


@pytest.mark.parametrize("setup", [True, False], ids=["setup_child", "bare"])
def test_a_child_leaving_by_os_exit_leaks_no_semaphore(tmp_path, setup):
    """A worker's progress bars (weights, graph capture) then `os._exit`: after
    setup_child the resource tracker finds nothing to clean up at shutdown; a bare
    child (the control) shows what every server's log ended with before."""
    script = tmp_path / "leak.py"
    script.write_text(LEAK_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script), "1" if setup else "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert ("leaked semaphore" in run.stderr) is not setup, run.stderr[-2000:]
