"""The cyclic garbage collector in the serving processes.

CPython's collector walks every tracked container object of the generations it
collects. A serving process holds a start-up heap that never becomes garbage (the
imported modules, the model and its graphs, the tokenizer, the app), and its loops
allocate many short-lived objects (rows, outputs, messages) that reference
counting frees without the collector. Left as it is, the collector runs a young
collection every 700 allocations and, now and then, a full one over the whole
heap: on the CPU (benchmarks/bench_host_step.py) that was ~40% of the scheduler's
time a decode row at 256 rows.

So once a process serves (`freeze_startup_heap`), its start-up heap leaves the
collector's generations for good (`gc.freeze`; vLLM and SGLang freeze theirs after
start-up too) and young collections run every `GEN0_THRESHOLD` allocations. Cycles
made later are still collected. Only processes freeze: a test process that built
engines would keep their cyclic garbage for good.

`GcPauses` counts the collections a process runs and the time they take
(`gc.callbacks`), for the line a worker or scheduler logs when it stops.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

# Allocations (net of frees) between young collections once serving; CPython's own
# default is 700. At this many, the scheduler's CPU benchmark ran as with no collector.
GEN0_THRESHOLD = 10_000


def freeze_startup_heap() -> None:
    """Collect once, move every object alive now out of the collector's generations
    for good, and make young collections rarer (module docstring)."""
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)


@dataclass
class GcPauses:
    """The collections of this process since `install`, per generation, and the time
    they took."""

    passes: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    longest_s: float = 0.0
    _began: float = 0.0

    def install(self) -> GcPauses:
        gc.callbacks.append(self._on_collect)
        return self

    def uninstall(self) -> None:
        if self._on_collect in gc.callbacks:
            gc.callbacks.remove(self._on_collect)

    def _on_collect(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._began = time.perf_counter()
            return
        took = time.perf_counter() - self._began
        gen = min(info["generation"], 2)
        self.passes[gen] += 1
        self.seconds[gen] += took
        self.longest_s = max(self.longest_s, took)

    def summary(self) -> str:
        """e.g. 'gc: 812 / 3 / 0 collections (generation 0 / 1 / 2), 41.2 ms in all,
        the longest 0.9 ms'."""
        counts = " / ".join(str(n) for n in self.passes)
        return (
            f"gc: {counts} collections (generation 0 / 1 / 2), "
            f"{sum(self.seconds) * 1e3:.1f} ms in all, the longest {self.longest_s * 1e3:.1f} ms"
        )
