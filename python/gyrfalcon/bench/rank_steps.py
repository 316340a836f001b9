"""Per-rank step costs from server logs: what each worker rank logs when it stops
(worker/step_stats.py: steps, host time, rows and, with GYRFALCON_STEP_TIMES=1, the
device span per kind of step), and a speculative server's step cost against a plain
one's on every rank.

    python -m gyrfalcon.bench.rank_steps --plain plain.log --spec spec.log \
        --name qwen3-30b-a3b_dp2ep2_c16 --device-kind nvidia-h100-x2 --output-json out.json

The spec step is acceptance-independent (its shapes are fixed by k), so a dummy drafter
measures it. Its cost on a rank: the mean device span of that rank's steady spec steps
(`fused`, the one-replay greedy step, and `graph`, a VERIFY replay then the draft
round) against the mean span of the plain server's `graph` (DECODE) steps there.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass

# "rank 1: 13 steps, 12 target forwards through graphs; fused 11 x 26.40 ms host (max
# 40.6), 2.0 rows, 1.23 ms device span; idle ..."
_RANK = re.compile(r"rank (\d+): (\d+) steps, (\d+) target forwards through graphs; (.*)")
_KIND = re.compile(
    r"(\w+) (\d+) x ([\d.]+) ms host \(max [\d.]+\), ([\d.]+) rows(?:, ([\d.]+) ms device span)?"
)
SPEC_KINDS = ("fused", "graph")  # a spec server's steady steps


@dataclass(frozen=True)
class KindFigures:
    steps: int
    host_ms: float  # mean host time to launch one
    rows: float  # mean rows
    device_ms: float | None  # mean device span (GYRFALCON_STEP_TIMES=1 only)


def rank_summaries(log: str) -> dict[int, dict[str, KindFigures]]:
    """rank -> kind -> its figures, from every rank's stop line in `log` (the last line
    of a rank wins: a log holding one server)."""
    out: dict[int, dict[str, KindFigures]] = {}
    for line in log.splitlines():
        found = _RANK.search(line)
        if found is None:
            continue
        kinds = {}
        for m in _KIND.finditer(found[4]):
            span = float(m[5]) if m[5] is not None else None
            kinds[m[1]] = KindFigures(int(m[2]), float(m[3]), float(m[4]), span)
        out[int(found[1])] = kinds
    return out


def mean_span(kinds: dict[str, KindFigures], names: tuple[str, ...]) -> tuple[float, int, float]:
    """(mean device ms, steps, mean rows) over the steps of these kinds, weighted by
    their counts; (nan, 0, nan) without timed steps of them."""
    timed = [kinds[n] for n in names if n in kinds and kinds[n].device_ms is not None]
    steps = sum(k.steps for k in timed)
    if not steps:
        return float("nan"), 0, float("nan")
    span = sum(k.device_ms * k.steps for k in timed) / steps  # type: ignore[operator]
    return span, steps, sum(k.rows * k.steps for k in timed) / steps


def spec_step_costs(plain_log: str, spec_log: str) -> list[dict]:
    """Per rank of the spec server: its spec steps' mean device span against the
    plain server's decode graph steps on the same rank, and their ratio."""
    plain, spec = rank_summaries(plain_log), rank_summaries(spec_log)
    rows = []
    for rank in sorted(spec):
        p_ms, p_steps, p_rows = mean_span(plain.get(rank, {}), ("graph",))
        s_ms, s_steps, s_rows = mean_span(spec[rank], SPEC_KINDS)
        idle = spec[rank].get("idle")
        rows.append(
            {
                "rank": rank,
                "plain_ms": p_ms,
                "plain_steps": p_steps,
                "plain_rows": p_rows,
                "spec_ms": s_ms,
                "spec_steps": s_steps,
                "spec_rows": s_rows,
                "spec_kinds": {k: asdict(v) for k, v in spec[rank].items()},
                "idle_steps": idle.steps if idle else 0,
                "ratio": s_ms / p_ms if p_steps and s_steps else float("nan"),
            }
        )
    return rows


def markdown_rows(name: str, costs: list[dict]) -> str:
    """One table row per rank: | name | rank | plain ms (rows) | spec ms (rows) | ratio |."""
    out = []
    for c in costs:
        out.append(
            f"| {name} | {c['rank']} | {c['plain_ms']:.3f} ({c['plain_rows']:.1f}) "
            f"| {c['spec_ms']:.3f} ({c['spec_rows']:.1f}) | {c['idle_steps']} "
            f"| **{c['ratio']:.2f}x** |"
        )
    return "\n".join(out) + "\n"


MD_HEADER = (
    "| run | rank | plain step ms (rows) | spec step ms (rows) | idle spec steps | ratio |\n"
    "| --- | ---: | ---: | ---: | ---: | ---: |\n"
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plain", required=True, help="the plain server's log")
    p.add_argument("--spec", required=True, help="the speculative server's log")
    p.add_argument("--name", required=True)
    p.add_argument("--device-kind", default="unknown")
    p.add_argument("--commit", default="unknown")
    p.add_argument("--output-json", required=True)
    a = p.parse_args(argv)
    with open(a.plain, errors="replace") as f:
        plain = f.read()
    with open(a.spec, errors="replace") as f:
        spec = f.read()
    costs = spec_step_costs(plain, spec)
    if not costs:
        print(f"no rank summaries in {a.spec}", file=sys.stderr)
        return 1
    report = {
        "bench": "rank_spec_step",
        "name": a.name,
        "device_kind": a.device_kind,
        "commit": a.commit,
        "ranks": costs,
    }
    with open(a.output_json, "w") as f:
        json.dump(report, f, indent=2)
    print(MD_HEADER + markdown_rows(a.name, costs), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
