"""Per-rank step costs read back from the lines the workers log (written here by
the workers' own StepStats, so a change of that format fails these tests)."""

import math

import torch

from gyrfalcon.bench.rank_steps import main, rank_summaries, spec_step_costs
from gyrfalcon.worker.step_stats import StepStats


def rank_line(rank: int, kinds: dict[str, tuple[int, float, int, float]], timed=True) -> str:
    """A worker's stop line: kind -> (steps, host s, rows, device s), all summed."""
    stats = StepStats(torch.device("cpu"))
    stats.timed = timed
    for name, (steps, host, rows, device) in kinds.items():
        k = stats.kinds[name]
        k.steps, k.host_s, k.max_host_s, k.rows, k.device_s = steps, host, host, rows, device
    n = sum(v[0] for v in kinds.values())
    return f"2026 [worker{rank}] INFO x: rank {rank}: {n} steps, {n} target forwards through graphs; {stats.summary()}"


PLAIN = "\n".join(
    [
        rank_line(0, {"graph": (100, 0.5, 800, 1.0), "eager": (2, 0.1, 2, 0.2)}),
        rank_line(1, {"graph": (100, 0.5, 800, 1.2)}),
    ]
)
SPEC = "\n".join(
    [
        rank_line(0, {"fused": (90, 0.5, 720, 1.26), "graph": (10, 0.1, 80, 0.14)}),
        rank_line(1, {"fused": (60, 0.5, 480, 0.9), "idle": (40, 0.1, 0, 0.3)}),
    ]
)


def test_the_workers_lines_parse_back():
    got = rank_summaries(PLAIN)
    assert set(got) == {0, 1}
    g = got[0]["graph"]
    assert (g.steps, g.rows) == (100, 8.0)
    assert math.isclose(g.host_ms, 5.0) and math.isclose(g.device_ms, 10.0)
    assert got[0]["eager"].steps == 2
    untimed = rank_summaries(rank_line(0, {"graph": (4, 0.1, 4, 0.0)}, timed=False))
    assert untimed[0]["graph"].device_ms is None


def test_spec_step_cost_per_rank_against_the_plain_step():
    costs = {c["rank"]: c for c in spec_step_costs(PLAIN, SPEC)}
    # rank 0: (1.26 + 0.14) s over 100 spec steps = 14 ms against 10 ms
    assert math.isclose(costs[0]["spec_ms"], 14.0) and math.isclose(costs[0]["ratio"], 1.4)
    assert costs[0]["spec_steps"] == 100 and costs[0]["idle_steps"] == 0
    # rank 1: 0.9 s over 60 fused steps = 15 ms against 12 ms; its idle steps apart
    assert math.isclose(costs[1]["ratio"], 15 / 12) and costs[1]["idle_steps"] == 40


def test_a_rank_without_timed_steps_has_no_ratio():
    untimed = rank_line(0, {"fused": (5, 0.1, 5, 0.0)}, timed=False)
    (cost,) = spec_step_costs(PLAIN, untimed)
    assert math.isnan(cost["ratio"])


def test_cli_writes_the_json_and_prints_a_row_per_rank(tmp_path, capsys):
    import json

    (tmp_path / "p.log").write_text(PLAIN)
    (tmp_path / "s.log").write_text(SPEC)
    out = tmp_path / "o.json"
    argv = ["--plain", str(tmp_path / "p.log"), "--spec", str(tmp_path / "s.log")]
    assert main([*argv, "--name", "moe", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    printed = capsys.readouterr().out
    assert "| moe | 0 | 10.000 (8.0) | 14.000 (8.0) | 0 | **1.40x** |" in printed
    (tmp_path / "empty.log").write_text("nothing")
    argv = ["--plain", str(tmp_path / "p.log"), "--spec", str(tmp_path / "empty.log")]
    assert main([*argv, "--name", "x", "--output-json", str(out)]) == 1
