"""Small process utilities shared by the launcher and the child processes."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (no orphans)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except OSError:
            pass


def setup_child(name: str, log_level: str) -> None:
    """Common start of a child process: logging, signals, parent-death signal."""
    configure_logging(log_level, name)
    die_with_parent()
    # NOTE: Ctrl-C reaches the whole process group; the launcher orders shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))


def configure_logging(level: str, name: str = "main") -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s [{name}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def parent_alive(ppid: int) -> bool:
    return os.getppid() == ppid
