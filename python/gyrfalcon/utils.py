"""Small process utilities shared by the launcher and the child processes.

Shutdown belongs to the launcher: it stops uvicorn first (requests in flight
finish), then sets the shared `stopping` flag and SIGTERMs its children. A child
therefore acts on SIGTERM only once that flag is set or its parent is gone; a
SIGTERM sent to the whole process group (`kill -TERM -PGID`, systemd) and
Ctrl-C's SIGINT are left to the launcher, and the children serve on until it
stops them. Children are spawned with both signals blocked (CHILD_START_BLOCKED)
and unblock them in `setup_child`, so none is lost or fatal while they import.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from multiprocessing.process import BaseProcess
from types import FrameType

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15
PROCESS_NAME_PREFIX = "gyr-"  # then "scheduler", "worker0", ...: within the 15 bytes
# NOTE: an OpenMP runtime reads these once, when it loads (at `import torch`), so
# they are set in the environment the children are spawned with. PASSIVE: threads
# waiting for work sleep instead of spinning on a core another process needs
# (GNU libgomp, which torch's wheels use, and Intel's runtime); KMP_BLOCKTIME=0:
# the same for Intel's runtime.
CHILD_OPENMP_ENV = {"OMP_WAIT_POLICY": "PASSIVE", "KMP_BLOCKTIME": "0"}
# Blocked while the launcher spawns children, until setup_child has its handlers in.
CHILD_START_BLOCKED = frozenset({signal.SIGINT, signal.SIGTERM})
CHILD_JOIN_TIMEOUT_S = 5.0  # how long a stopped child may take before it is killed
SHUTDOWN_GRACE_S = 5.0  # after --shutdown-timeout, for the ended requests' last bytes
# NOTE: prometheus-client's multiprocess directory variable (--api-server-count > 1),
# named here, where nothing imports prometheus-client: the launcher sets it before any
# API server imports it, frontend/metrics.py reads it
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"


def _prctl(option: int, arg: object) -> None:
    """prctl(2) where Linux has it; nothing elsewhere."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(option, arg)
        except OSError:
            pass


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (no orphans)."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def set_process_name(name: str) -> None:
    """Name this process as ps, top and /proc/PID/comm show it (15 bytes at most)."""
    _prctl(PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]))


class ChildStop:
    """When a child process stops (see the module docstring).

    Until `serving()` is called, an accepted SIGTERM raises SystemExit(0) at once
    (a worker may load a model for minutes); from then on it only sets
    `requested`, and the main loop returns at its next poll, so no exception is
    raised inside arbitrary code (a half-done step, an atexit callback).
    """

    def __init__(self, stopping: ctypes.c_bool) -> None:
        self.requested = False
        self._stopping = stopping  # shared with the launcher; set before it SIGTERMs us
        self._ppid = os.getppid()
        self._raise = True

    def serving(self) -> None:
        """The main loop starts: from now on a stop is noticed at its next poll."""
        self._raise = False

    def parent_gone(self) -> bool:
        return os.getppid() != self._ppid

    def on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        if self.requested or not (self._stopping.value or self.parent_gone()):
            return  # NOTE: a group SIGTERM; the launcher stops us once HTTP has drained
        self.requested = True
        if self._raise:
            raise SystemExit(0)


def setup_child(name: str, log_level: str, stopping: ctypes.c_bool) -> ChildStop:
    """Common start of a child process: logging, signals, parent-death signal."""
    configure_logging(log_level, name)
    set_process_name(PROCESS_NAME_PREFIX + name)
    stop = ChildStop(stopping)
    # NOTE: Ctrl-C reaches the whole process group; the launcher orders shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, stop.on_sigterm)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, CHILD_START_BLOCKED)  # blocked by the launcher
    die_with_parent()
    use_a_thread_lock_for_progress_bars()
    return stop


def use_a_thread_lock_for_progress_bars() -> None:
    """tqdm's first bar makes a multiprocessing lock: a named semaphore that the
    resource tracker records. A child leaves by `os._exit` (worker/process.py), so
    it never releases it, and at shutdown the tracker unlinks it with a "leaked
    semaphore objects" warning, one per worker (stop 48). A spawned child's bars
    share that lock with no other process anyway; a thread lock serves the same."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def start_children(procs: Sequence[BaseProcess]) -> None:
    """Start the children with OpenMP's busy-wait off (set_child_openmp_env) and the
    group's signals blocked: they inherit the mask (it survives exec) and unblock the
    signals once their handlers are in (setup_child), so a group signal that comes
    while a child still imports torch waits for them instead of killing it."""
    set_child_openmp_env()
    signal.pthread_sigmask(signal.SIG_BLOCK, CHILD_START_BLOCKED)
    try:
        for p in procs:
            p.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, CHILD_START_BLOCKED)


def dead_child(procs: Sequence[BaseProcess]) -> BaseProcess | None:
    """A child that has exited (they serve until stopped), or None."""
    return next((p for p in procs if not p.is_alive()), None)


def stop_children(procs: Sequence[BaseProcess], timeout_s: float | None = None) -> None:
    """SIGTERM the children that still run, give them `timeout_s` (None:
    CHILD_JOIN_TIMEOUT_S) together (not each: four GPU workers stuck in their teardown
    once took 20 s), SIGKILL the late ones. Set the shared `stopping` flag first: the
    children act on a SIGTERM only then."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + (CHILD_JOIN_TIMEOUT_S if timeout_s is None else timeout_s)
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            logger.warning("%s did not stop; killing it", p.name)
            p.kill()
            p.join()


def set_child_openmp_env() -> None:
    """Keep OpenMP from busy-waiting in the processes started from now on, unless
    the user chose a wait policy (CHILD_OPENMP_ENV)."""
    for key, value in CHILD_OPENMP_ENV.items():
        os.environ.setdefault(key, value)


def set_torch_threads(num_threads: int | None) -> None:
    """Run this process's torch on `num_threads` threads (None: torch's default)
    and one inter-op thread, where that can still be set; log the counts.

    Where torch is not loaded (the scheduler never imports it), OMP_NUM_THREADS
    and MKL_NUM_THREADS are set instead, so a later import starts that way. Call
    it in the launcher only after torch is imported: the children would inherit
    the variables.
    """
    torch = sys.modules.get("torch")
    if torch is None:
        assert num_threads is not None
        os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(num_threads)
        logger.info("torch threads: %d (torch not loaded; OMP_NUM_THREADS set)", num_threads)
        return
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        torch.set_num_interop_threads(1)  # nothing here runs inter-op work (no jit.fork)
    except RuntimeError:
        pass  # NOTE: settable only before this process's first inter-op work
    logger.info(
        "torch threads: %d (inter-op %d)", torch.get_num_threads(), torch.get_num_interop_threads()
    )


def configure_logging(level: str, name: str = "main") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s [{name}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def free_port(host: str = "127.0.0.1", avoid: int | None = None) -> int:
    """A TCP port free on host now (the OS's pick; another process may take it later),
    never `avoid` (a port picked already but not bound yet, e.g. the HTTP server's)."""
    import socket

    while True:
        with socket.socket() as sock:
            sock.bind((host, 0))
            port = sock.getsockname()[1]
        if port != avoid:
            return port
