"""StepWorker on the edge it shares with the scheduler: its DP rank's batch of a plan,
token-list results, and IDLE batches that still run a dummy row."""

import pytest
import torch

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.ipc.contract import DUMMY_PAGE, PLACEHOLDER, RankLayout
from gyrfalcon.ipc.messages import (
    ForwardMode,
    NewRequest,
    RankBatch,
    SamplingParams,
    ScheduledRow,
    StepPlan,
)
from gyrfalcon.worker.bootstrap import build_worker

PS = 4


def worker(tiny_model_dirs, static=False, dp_rank=0, **kw):
    d = tiny_model_dirs["llama"]
    args = ServerArgs(
        model=d, device="cpu", dtype="float32", page_size=PS, num_kv_pages=32,
        static_graph_replay=static, **kw,
    ).resolved()  # fmt: skip
    # NOTE: rank dp_rank of dp_rank + 1 DP groups of one rank each: no process group
    layout = RankLayout(dp_size=dp_rank + 1)
    return build_worker(args, d, ModelConfig.from_dir(d), rank=dp_rank, layout=layout)[0]


def only_dummy_page_written(kv) -> bool:
    dummy = slice(DUMMY_PAGE * PS, (DUMMY_PAGE + 1) * PS)
    rest = torch.ones(kv.k.shape[1], dtype=torch.bool)
    rest[dummy] = False
    written = kv.k[:, dummy].abs().sum() > 0 and kv.v[:, dummy].abs().sum() > 0
    return bool(written) and not kv.k[:, rest].any() and not kv.v[:, rest].any()


@pytest.mark.parametrize("static", [False, True])
def test_idle_step_runs_a_dummy_row_on_the_dummy_page_only(tiny_model_dirs, static):
    w = worker(tiny_model_dirs, static)
    kv = w.executor.kv_cache
    kv.k.zero_()
    kv.v.zero_()
    runs = w.executor.graphs.num_runs if static else 0
    result = w.execute(StepPlan(5, [RankBatch(ForwardMode.IDLE, [])]))
    assert result.step_id == 5 and result.rows == [] and result.dp_rank == 0
    assert only_dummy_page_written(kv)  # the dummy forward ran, and touched nothing else
    if static:  # through the same decode graph as real rows
        assert w.executor.graphs.num_runs == runs + 1
    assert not w.requests and not w.pending


def test_worker_runs_its_dp_ranks_batch_and_returns_token_lists(tiny_model_dirs):
    w = worker(tiny_model_dirs, dp_rank=1)
    sp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2)
    mine = RankBatch(
        ForwardMode.PREFILL,
        [ScheduledRow("r", 0, [5, 6, 7], [1], True)],
        [NewRequest("r", [5, 6, 7], sp)],
    )
    # rank 0's batch names a request this worker never got: running it would fail
    other = RankBatch(ForwardMode.DECODE, [ScheduledRow("x", 9, [1], [2], True)])
    result = w.execute(StepPlan(0, [other, mine]))
    assert result.dp_rank == 1 and [r.rid for r in result.rows] == ["r"]
    row = result.rows[0]
    assert len(row.token_ids) == 1 and row.num_accepted == 0  # no drafts: one token
    assert [lp.token_id for lp in row.logprobs] == row.token_ids
    # the next step's PLACEHOLDER input is the last emitted token, filled on the device
    slot = w.requests["r"].slot
    assert int(w.requests.last_tokens[slot]) == row.token_ids[-1]
    drop = RankBatch(ForwardMode.IDLE, [], [], ["r"])
    assert w.execute(StepPlan(1, [RankBatch(ForwardMode.IDLE, []), drop])).rows == []
    assert not w.requests


@pytest.mark.parametrize("piecewise", [0, 16], ids=["eager", "piecewise"])
def test_summary_counts_each_kind_of_step(tiny_model_dirs, piecewise):
    """The exit log line says how each step ran: the prompt eagerly (or through the
    piecewise graphs), its decodes through the (static) graph, an IDLE step as a dummy
    row; rows per step and host time each."""
    w = worker(tiny_model_dirs, static=True, piecewise_cuda_graph_max_tokens=piecewise)
    prefill = "piecewise" if piecewise else "eager"
    sp = SamplingParams(temperature=0.0, max_tokens=4)
    new = [NewRequest("r", [5, 6, 7], sp)]
    w.execute(
        StepPlan(
            0, [RankBatch(ForwardMode.PREFILL, [ScheduledRow("r", 0, [5, 6, 7], [1], True)], new)]
        )
    )
    for i in range(2):
        row = ScheduledRow("r", 3 + i, [PLACEHOLDER], [1], True)
        w.execute(StepPlan(1 + i, [RankBatch(ForwardMode.DECODE, [row])]))
    w.execute(StepPlan(3, [RankBatch(ForwardMode.IDLE, [], [], ["r"])]))
    kinds = {k: (s.steps, s.rows) for k, s in w.stats.kinds.items() if s.steps}
    assert kinds == {prefill: (1, 1), "graph": (2, 2), "idle": (1, 0)}
    assert all(s.host_s > 0 for s in w.stats.kinds.values() if s.steps)
    text = w.summary()
    assert text.startswith("4 steps, ") and "; graph 2 x " in text
    assert f"; {prefill} 1 x " in text and "; idle 1 x " in text and "; waited 0.00 s" in text
