"""Host profiles (cProfile) of the engine's loops and of benchmark phases.

`GYRFALCON_PROFILE_DIR=DIR gyrfalcon serve ...` profiles the scheduler and every
worker process from start to stop and writes `DIR/<process>.txt` (the top functions
by own time, then by cumulative time) when the process ends: where a served step's
host time goes, which `bench_*.py --profile-dir` cannot see (they drive an
in-process engine). The profiler costs the profiled process some speed.
"""

from __future__ import annotations

import contextlib
import cProfile
import logging
import os
import pstats
from collections.abc import Iterator

logger = logging.getLogger(__name__)

PROFILE_DIR_ENV = "GYRFALCON_PROFILE_DIR"
TOP = 90  # functions listed per ordering


def write_stats(prof: cProfile.Profile, path: str, header: str = "", top: int = TOP) -> None:
    """The profile's top functions by own time, then by cumulative time, to `path`."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        if header:
            f.write(header.rstrip("\n") + "\n")
        for key in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=f).sort_stats(key).print_stats(top)


@contextlib.contextmanager
def host_profile(path: str | None, header: str = "") -> Iterator[None]:
    """cProfile the block and write its stats to `path` (nothing when path is None)."""
    if path is None:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        write_stats(prof, path, header)


def process_profile(name: str) -> contextlib.AbstractContextManager[None]:
    """The profile of process `name` under $GYRFALCON_PROFILE_DIR, if it is set."""
    root = os.environ.get(PROFILE_DIR_ENV)
    if not root:
        return contextlib.nullcontext()
    path = os.path.join(root, f"{name}.txt")
    logger.info("host profile of this process goes to %s at its end", path)
    return host_profile(path, f"host profile of {name} (pid {os.getpid()})")
