"""Where a step's device time goes, from a torch profiler trace (its Chrome JSON).

A replayed CUDA graph's kernels carry the correlation id of the `cudaGraphLaunch` that
launched them, so each launch's device work can be told apart from the step's other
device work (uploads, fills, copies back). Per launch: its span (first kernel's start
to the last one's end: the device time of the graph, whatever the host did meanwhile,
since every node is queued at once), and each kernel's end minus the previous one's
end, summed by kernel name (with programmatic dependent launch kernels overlap, so
durations do not add up to the span; these deltas do, and say which kernels the span
grew in). Ops outside every launch are counted per launch.

Used by bench_decode.py --profile-dir (`device_timeline_bs*.txt`); on nvidia-h200 it
found SmolLM2's batch-1 decode graph 26 us longer at 7985620 than at 3758f27, 11.5 us of
it in the attention kernel's end deltas (benchmarks/NOTES.md, 2026-12-03).
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass(frozen=True)
class DeviceOp:
    name: str
    start: float  # us
    dur: float  # us

    @property
    def end(self) -> float:
        return self.start + self.dur


def short_name(name: str) -> str:
    """A kernel's name without return type, template arguments or parameters
    ("void at::native::foo<1, 2>(int)" -> "at::native::foo"); memcpy names as they are."""
    if name.startswith("Memcpy") or name.startswith("Memset"):
        return name
    name = re.sub(r"^void ", "", name)
    depth, out = 0, []
    for ch in name:  # NOTE: drop every <...> group, nested ones included
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif depth == 0:
            if ch == "(":
                break
            out.append(ch)
    return "".join(out).strip()


def split_by_launch(trace: dict) -> tuple[list[list[DeviceOp]], list[DeviceOp]]:
    """(each `cudaGraphLaunch`'s device ops in launch order, each list by start; the
    device ops of no launch, by start) of a torch profiler Chrome trace."""
    events = trace["traceEvents"]
    launch_of = {}
    for e in events:
        if e.get("name") == "cudaGraphLaunch" and "correlation" in e.get("args", {}):
            launch_of[e["args"]["correlation"]] = e["ts"]
    by_launch: dict[int, list[DeviceOp]] = {c: [] for c in launch_of}
    other: list[DeviceOp] = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in DEVICE_CATS:
            continue
        op = DeviceOp(e["name"], float(e["ts"]), float(e["dur"]))
        corr = e.get("args", {}).get("correlation")
        (by_launch[corr] if corr in by_launch else other).append(op)
    launches = [
        sorted(by_launch[c], key=lambda o: o.start) for c in sorted(launch_of, key=launch_of.get)
    ]
    return [ops for ops in launches if ops], sorted(other, key=lambda o: o.start)


def summarize(launches: list[list[DeviceOp]], other: list[DeviceOp], skip: int = 2) -> dict:
    """Span (median, min), ops per launch and end deltas by kernel (us per launch) of the
    launches after the first `skip` (those may still have waited on earlier work), and
    the ops outside launches per launch (count, summed duration)."""
    kept = launches[skip:]
    assert kept, f"{len(launches)} graph launches, {skip} skipped: none left"
    spans = [max(o.end for o in ops) - ops[0].start for ops in kept]
    deltas: dict[str, float] = {}
    for ops in kept:
        for prev, op in zip(ops, ops[1:]):
            key = short_name(op.name)
            deltas[key] = deltas.get(key, 0.0) + op.end - prev.end
    n = len(kept)
    # NOTE: the ops outside launches while the kept ones ran (the steps' own)
    first, last = kept[0][0].start, max(o.end for o in kept[-1])
    outside = [o for o in other if first <= o.start <= last]
    return {
        "launches": n,
        "span_us_median": statistics.median(spans),
        "span_us_min": min(spans),
        "ops_per_launch": statistics.median(len(ops) for ops in kept),
        "end_delta_us": {k: v / n for k, v in sorted(deltas.items(), key=lambda kv: -kv[1])},
        "outside_ops_per_launch": len(outside) / n,
        "outside_us_per_launch": sum(o.dur for o in outside) / n,
    }


def format_summary(summary: dict) -> str:
    lines = [
        f"{summary['launches']} graph launches: span median {summary['span_us_median']:.1f} us "
        f"(min {summary['span_us_min']:.1f}), {summary['ops_per_launch']:g} ops each",
        f"outside launches: {summary['outside_ops_per_launch']:.1f} ops, "
        f"{summary['outside_us_per_launch']:.1f} us of device time per launch",
        "end deltas by kernel (us per launch):",
    ]
    lines += [f"  {us:8.1f}  {name}" for name, us in summary["end_delta_us"].items()]
    return "\n".join(lines) + "\n"
