"""Which thread of a server is busy: every thread of a process tree sampled from /proc
while a command (a benchmark client) runs, each thread's share of one core over that
window, its mean and its busiest interval.

A server whose GPU waits on the host is bound either by one thread at ~100% of a core
(the frontend's event loop, the scheduler's loop or a worker's launch thread) or by a
chain of them, each busy part of the time while it waits on the others; this tells which.

    python -m gyrfalcon.bench.proc_cpu --root SERVER_PID --output-json cpu.json -- \\
        python -m gyrfalcon.cli bench serve ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

PROC = Path("/proc")
BUSY = 0.9  # an interval at >= 90% of a core counts as busy


def cpu_seconds(stat: str, ticks_per_s: float) -> float:
    """User + system CPU time in /proc/<pid>/stat's text (fields 14 and 15; the command
    name, field 2, may hold spaces: fields are counted after its closing parenthesis)."""
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / ticks_per_s


def stat_name(stat: str) -> str:
    """The command name in a /proc stat line (field 2, inside the parentheses)."""
    return stat[stat.index("(") + 1 : stat.rindex(")")]


def stat_ppid(stat: str) -> int:
    """The parent's pid in a /proc stat line (field 4)."""
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def descendants(root: int, parents: dict[int, int]) -> list[int]:
    """`root` and every process under it, from a pid -> parent pid map."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return sorted(out)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # the process or thread ended between listing and reading
        return None


def process_parents() -> dict[int, int]:
    out = {}
    for d in PROC.iterdir():
        if d.name.isdigit() and (s := _read(d / "stat")) is not None:
            out[int(d.name)] = stat_ppid(s)
    return out


Key = tuple[int, int]  # (pid, tid)


def sample(pids: Iterable[int], hz: float) -> dict[Key, tuple[str, str, float]]:
    """Every thread of `pids`: (process name, thread name, CPU seconds so far)."""
    out = {}
    for pid in pids:
        if (ps := _read(PROC / str(pid) / "stat")) is None:
            continue
        try:
            tids = [int(t.name) for t in (PROC / str(pid) / "task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            if (ts := _read(PROC / str(pid) / "task" / str(tid) / "stat")) is not None:
                out[(pid, tid)] = (stat_name(ps), stat_name(ts), cpu_seconds(ts, hz))
    return out


@dataclass
class ThreadLoad:
    pid: int
    tid: int
    process: str
    thread: str
    cpu_s: float  # CPU seconds over the window
    mean: float  # share of one core over the window
    max: float  # share of one core in its busiest interval
    busy: float  # share of the intervals at >= BUSY of a core


def thread_loads(
    samples: list[tuple[float, dict[Key, tuple[str, str, float]]]],
) -> list[ThreadLoad]:
    """Each thread's load from timed samples (monotonic seconds, `sample`'s map), busiest
    first; a thread seen in only some samples counts from its first to its last."""
    if len(samples) < 2:
        return []
    window = samples[-1][0] - samples[0][0]
    seen: dict[Key, list[tuple[float, float]]] = {}
    names: dict[Key, tuple[str, str]] = {}
    for t, snap in samples:
        for key, (proc, thread, cpu) in snap.items():
            seen.setdefault(key, []).append((t, cpu))
            names[key] = (proc, thread)
    loads = []
    for key, points in seen.items():
        if len(points) < 2:
            continue
        shares = [(c1 - c0) / (t1 - t0) for (t0, c0), (t1, c1) in zip(points, points[1:])]
        cpu = points[-1][1] - points[0][1]
        loads.append(
            ThreadLoad(
                pid=key[0],
                tid=key[1],
                process=names[key][0],
                thread=names[key][1],
                cpu_s=round(cpu, 2),
                mean=round(cpu / window, 3),
                max=round(max(shares), 3),
                busy=round(sum(s >= BUSY for s in shares) / len(shares), 3),
            )
        )
    return sorted(loads, key=lambda x: -x.cpu_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=int, required=True, help="the server's pid")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    p.add_argument("--top", type=int, default=16, help="threads kept, busiest first")
    p.add_argument("--output-json", type=Path)
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to time")
    ns = p.parse_args(argv)
    cmd = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
    if not cmd:
        p.error("no command given (put it after --)")
    hz = os.sysconf("SC_CLK_TCK")
    proc = subprocess.Popen(cmd)

    def snap() -> tuple[float, dict[Key, tuple[str, str, float]]]:
        parents = process_parents()  # NOTE: the command's own threads too (the client)
        return time.monotonic(), sample(
            descendants(ns.root, parents) + descendants(proc.pid, parents), hz
        )

    samples = [snap()]
    while proc.poll() is None:
        try:
            proc.wait(ns.interval)
        except subprocess.TimeoutExpired:
            pass
        samples.append(snap())
    loads = thread_loads(samples)[: ns.top]
    window = samples[-1][0] - samples[0][0]
    print(f"threads of pid {ns.root} and of the command (pid {proc.pid}) over {window:.1f} s")
    print("  (share of one core: mean / max, and the share of intervals at >= 90%):")
    for x in loads:
        who = "command" if x.pid == proc.pid else x.process
        print(f"  {who:>15} / {x.thread:<15} {x.mean:6.2f} / {x.max:4.2f} busy {x.busy:.2f}")
    if ns.output_json:
        doc = {"root": ns.root, "command_pid": proc.pid, "window_s": round(window, 2)}
        doc |= {"interval_s": ns.interval, "threads": [asdict(x) for x in loads]}
        ns.output_json.write_text(json.dumps(doc, indent=1) + "\n")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
