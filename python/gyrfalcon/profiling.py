"""Host profiles (cProfile) of the engine's loops and of benchmark phases.

`GYRFALCON_PROFILE_DIR=DIR gyrfalcon serve ...` profiles the scheduler and every
worker process from start to stop and writes `DIR/<process>.txt` (the top functions
by own time, then by cumulative time) when the process ends: where a served step's
host time goes, which `bench_*.py --profile-dir` cannot see (they drive an
in-process engine). The profiler costs the profiled process some speed.

`GYRFALCON_SECTION_TIMES=DIR gyrfalcon serve ...` times the named step phases of
every worker (`worker/sections.py`) with perf_counter pairs only (`SectionTimes`: no
profiler's inflation) while it serves, and writes `DIR/sections_<process>_<pid>.md`
at its end: the same table `bench_spec_step.py --time-sections` makes in-process.
"""

from __future__ import annotations

import contextlib
import cProfile
import functools
import logging
import os
import pstats
import time
from collections.abc import Callable, Iterator

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


KERNEL_PROFILE_ENV = "GYRFALCON_KERNEL_PROFILE"  # DIR[:FIRST:COUNT[,FIRST:COUNT...]]


def kernel_windows(spec: str) -> tuple[str, list[tuple[int, int]]]:
    """(DIR, [(first, last) plan of each window]) of `DIR[:FIRST:COUNT[,FIRST:COUNT...]]`
    (plans counted from 1; default one window, 300 .. 399). Windows must be in order and
    apart: each closes before the next opens."""
    root, _, rest = spec.partition(":")
    windows: list[tuple[int, int]] = []
    for part in (rest or "300:100").split(","):
        first, _, count = part.partition(":")
        start, n = int(first or 300), int(count or 100)
        if start < 1 or n < 1 or (windows and start <= windows[-1][1] + 1):
            raise ValueError(f"kernel profile windows {rest!r}: each FIRST:COUNT >= 1, in order")
        windows.append((start, start + n - 1))
    return root, windows


class KernelWindow:
    """The device's kernels over windows of a loop's steps: a served worker's plans,
    or `train-eagle3`'s training steps (torch.profiler, CUDA graph replays included),
    for `GYRFALCON_KERNEL_PROFILE=DIR[:FIRST:COUNT[,FIRST:COUNT...]]` (`kernel_windows`):
    steps FIRST .. FIRST + COUNT - 1 (default 300 and 100) of process `name`, written
    to `DIR/kernels_<name>.txt` (the first window; `kernels_<name>_<FIRST>.txt` for the
    others) by total device time once the window closes: a prefill's steps and a
    decode's apart, say. What a served step's device time goes to, on every rank
    (`bench_*.py --profile-dir` see only the in-process engine's one rank), or a
    training step's. Does nothing when the variable is unset."""

    def __init__(self, name: str, spec: str | None = None):
        spec = os.environ.get(KERNEL_PROFILE_ENV) if spec is None else spec
        self.name, self.plans, self.prof = name, 0, None
        self.root: str | None = None
        self.windows: list[tuple[int, int]] = []
        if spec:
            self.root, self.windows = kernel_windows(spec)

    def plan(self, device) -> None:
        """Before the next plan is submitted: opens or closes a window (after waiting
        for `device`, a torch.device: a window holds whole steps)."""
        if self.root is None:
            return
        import torch

        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        self.plans += 1
        for i, (first, last) in enumerate(self.windows):
            if self.plans == first:
                from torch.profiler import ProfilerActivity, profile

                sync()
                self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                self.prof.__enter__()
            elif self.plans == last + 1 and self.prof is not None:
                sync()
                self.prof.__exit__(None, None, None)
                self._write(first, last, "" if i == 0 else f"_{first}")
                self.prof = None

    def _write(self, first: int, last: int, suffix: str) -> None:
        assert self.prof is not None and self.root is not None
        table = self.prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=60, max_name_column_width=80
        )
        os.makedirs(self.root, exist_ok=True)
        path = os.path.join(self.root, f"kernels_{self.name}{suffix}.txt")
        with open(path, "w") as f:
            f.write(f"{self.name}: plans {first} .. {last}\n{table}\n")
        logger.info("kernel profile of plans %d .. %d written to %s", first, last, path)


class SectionTimes:
    """Host wall time of named callables over a block, without a profiler's inflation:
    each target `(owner, attribute)` (a class's method, or a module's function where
    its caller looks it up) is wrapped by a perf_counter pair while the block runs,
    then restored. Totals include the callees (nested sections overlap); nothing
    waits for the device, so a section's time is its host cost (its launches)."""

    def __init__(self, targets: dict[str, tuple[object, str]]):
        self.targets = targets
        self.calls = dict.fromkeys(targets, 0)
        self.seconds = dict.fromkeys(targets, 0.0)
        self._saved: list[tuple[object, str, object]] = []

    def __enter__(self) -> SectionTimes:
        for name, (owner, attr) in self.targets.items():
            fn, raw = getattr(owner, attr), vars(owner)[attr]
            assert not isinstance(raw, (staticmethod, classmethod)), name
            self._saved.append((owner, attr, raw))

            def timed(*a, _fn=fn, _name=name, **kw):
                t0 = time.perf_counter()
                try:
                    return _fn(*a, **kw)
                finally:
                    self.seconds[_name] += time.perf_counter() - t0
                    self.calls[_name] += 1

            setattr(owner, attr, functools.wraps(fn)(timed))
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved = []

    def table(self, per: int, per_name: str) -> str:
        """Markdown rows: each section's calls, total ms, ms per `per_name` (total / per)
        and us per call."""
        lines = [
            f"| section | calls | total ms | ms per {per_name} | us per call |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for name in self.targets:
            n, s = self.calls[name], self.seconds[name]
            lines.append(
                f"| {name} | {n} | {s * 1e3:.1f} | {s * 1e3 / max(per, 1):.3f} | "
                f"{s * 1e6 / max(n, 1):.1f} |"
            )
        return "\n".join(lines) + "\n"


SECTION_TIMES_ENV = "GYRFALCON_SECTION_TIMES"  # DIR


@contextlib.contextmanager
def process_sections(
    name: str, targets: Callable[[], dict[str, tuple[object, str]]], plans: Callable[[], int]
) -> Iterator[None]:
    """SectionTimes of `targets()` over the block, written per plan (`plans()` at the
    end: how many ran) to $GYRFALCON_SECTION_TIMES/sections_<name>_<pid>.md when the
    block ends; nothing (targets() not even called) when the variable is unset."""
    root = os.environ.get(SECTION_TIMES_ENV)
    if not root:
        yield
        return
    path = os.path.join(root, f"sections_{name}_{os.getpid()}.md")
    logger.info("host time of this process's step sections goes to %s at its end", path)
    times = SectionTimes(targets())
    try:
        with times:
            yield
    finally:
        n = plans()
        os.makedirs(root, exist_ok=True)
        with open(path, "w") as f:
            f.write(f"# {name} (pid {os.getpid()}): {n} plans\n\n{times.table(n, 'plan')}")
