"""Where a worker's time goes, per kind of step: logged when the worker stops.

Kinds: `fused` (the whole greedy spec step in one replay), `graph` (the target's
forward replayed from a graph), `whole` (a prefill chunk or mixed step as one graph
over any rows) or `piecewise` (one through piecewise graphs, worker/piecewise_graph.py),
`eager` (the target's forward launched
op by op: a size no graph serves) and `idle` (a DP rank's dummy row). For each:
how many steps, their mean rows, and the host time spent launching them. `waited`
sums the gaps under `SHORT_GAP_S` in which the worker had nothing in flight and
waited for the next plan: the device idled on the scheduler then (longer gaps are a
server without work).

With `GYRFALCON_STEP_TIMES=1` each step also records CUDA events around its launch:
the device-stream span of a kind (from its first kernel's queueing point to its last
kernel's end) says whether those steps were bound by the device or by the host
launching them (span ~ host time).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

STEP_TIMES_ENV = "GYRFALCON_STEP_TIMES"
KINDS = ("fused", "graph", "whole", "piecewise", "eager", "idle")
SHORT_GAP_S = 0.1


@dataclass
class KindStats:
    steps: int = 0
    rows: int = 0
    host_s: float = 0.0
    max_host_s: float = 0.0  # the slowest launch (a kernel compiling shows here)
    device_s: float = 0.0  # summed event spans (GYRFALCON_STEP_TIMES only)

    def line(self, name: str, timed: bool) -> str:
        n = self.steps
        mean, most = 1e3 * self.host_s / n, 1e3 * self.max_host_s
        text = f"{name} {n} x {mean:.2f} ms host (max {most:.1f}), {self.rows / n:.1f} rows"
        if timed:
            text += f", {1e3 * self.device_s / n:.2f} ms device span"
        return text


class StepStats:
    """Per-kind counts and times of one worker's steps (`begin` / `end` around a launch;
    `span_done` once its events completed)."""

    def __init__(self, device: torch.device):
        self.kinds = {k: KindStats() for k in KINDS}
        self.timed = device.type == "cuda" and os.environ.get(STEP_TIMES_ENV) == "1"
        self.waiting_s = 0.0
        self.gaps = 0
        self._wait_from: float | None = None

    def begin(self) -> tuple[float, torch.cuda.Event | None]:
        start = None
        if self.timed:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        return time.perf_counter(), start

    def end(
        self, kind: str, rows: int, began: tuple[float, torch.cuda.Event | None]
    ) -> tuple[str, torch.cuda.Event, torch.cuda.Event] | None:
        """Count a launched step; returns its (kind, start, end) events to time once the
        step is done (`span_done`), or None when not timing."""
        t0, start = began
        stats = self.kinds[kind]
        stats.steps += 1
        stats.rows += rows
        took = time.perf_counter() - t0
        stats.host_s += took
        stats.max_host_s = max(stats.max_host_s, took)
        if start is None:
            return None
        stop = torch.cuda.Event(enable_timing=True)
        stop.record()
        return kind, start, stop

    def span_done(self, span: tuple[str, torch.cuda.Event, torch.cuda.Event] | None) -> None:
        if span is not None:
            kind, start, stop = span
            stop.synchronize()
            self.kinds[kind].device_s += start.elapsed_time(stop) / 1e3

    def idle(self, waiting: bool) -> None:
        """Mark whether the worker is waiting for a plan with nothing in flight."""
        now = time.perf_counter()
        if waiting and self._wait_from is None:
            self._wait_from = now
        elif not waiting and self._wait_from is not None:
            gap = now - self._wait_from
            self._wait_from = None
            if gap < SHORT_GAP_S:
                self.waiting_s += gap
                self.gaps += 1

    def summary(self) -> str:
        parts = [s.line(k, self.timed) for k, s in self.kinds.items() if s.steps]
        gaps = f"waited {self.waiting_s:.2f} s for plans with nothing in flight"
        parts.append(f"{gaps} ({self.gaps} gaps under {SHORT_GAP_S:g} s)")
        return "; ".join(parts)
