"""The scheduler process's loop over real ZMQ sockets with N fake worker ranks: every
rank gets every plan, the engine is ready once every rank is (smallest pool wins),
and each DP group's results come from its first TP rank only."""

import ctypes
import threading
from types import SimpleNamespace

import pytest
import zmq

from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.ipc.contract import RankLayout
from gyrfalcon.ipc.messages import (
    BatchOutput,
    EngineReady,
    GenerateRequest,
    RowResult,
    SamplingParams,
    SchedulerToFrontend,
    SchedulerToWorker,
    Shutdown,
    StepResult,
    WorkerReady,
)
from gyrfalcon.ipc.sockets import Channel, IpcPaths
from gyrfalcon.scheduler.process import SchedulerLoop
from gyrfalcon.utils import ChildStop

RECV_MS = 10_000


def fake_rank(paths: IpcPaths, rank: int, layout: RankLayout, pages: int, seen: list) -> None:
    """A worker rank: ready, then its DP group's batch of every plan (token 7 per sample)."""
    ctx = zmq.Context.instance()
    inbox = Channel(ctx, zmq.PULL, paths.scheduler_to_workers[rank], False, SchedulerToWorker)
    outbox = Channel(ctx, zmq.PUSH, paths.worker_to_scheduler, False)
    outbox.send(WorkerReady(rank, pages, 64))
    dp = layout.dp_rank(rank)
    try:
        while True:
            plan = inbox.recv(RECV_MS)
            if plan is None or isinstance(plan, Shutdown):
                return
            seen.append(plan.step_id)
            rows = [RowResult(r.rid, [7] if r.sample else []) for r in plan.batches[dp].rows]
            if layout.reports(rank):
                outbox.send(StepResult(plan.step_id, rows, dp))
    finally:
        inbox.close()
        outbox.close()


@pytest.mark.parametrize("layout", [RankLayout(), RankLayout(dp_size=2, tp_size=2)])
def test_loop_serves_every_rank(layout):
    paths, _ = IpcPaths.create(layout.world_size)
    args = ServerArgs(
        model="m", device="cpu", page_size=4, max_num_batched_tokens=64,
        chunked_prefill_size=64, log_stats_interval=0, check_invariants=True,
    )  # fmt: skip
    model_cfg = SimpleNamespace(eos_token_ids=(99,))
    loop = SchedulerLoop(args, paths, model_cfg, ChildStop(ctypes.c_bool(False)), layout)
    ctx = zmq.Context.instance()
    to_sched = Channel(ctx, zmq.PUSH, paths.frontend_to_scheduler, False)
    from_sched = Channel(ctx, zmq.PULL, paths.scheduler_to_frontend, False, SchedulerToFrontend)
    seen: list[list[int]] = [[] for _ in range(layout.world_size)]
    pages = [40 + 3 * r for r in range(layout.world_size)]
    ranks = [
        threading.Thread(target=fake_rank, args=(paths, r, layout, pages[r], seen[r]))
        for r in range(layout.world_size)
    ]
    for t in ranks:
        t.start()
    try:
        loop.start()
        ready = from_sched.recv(RECV_MS)
        assert isinstance(ready, EngineReady) and ready.num_kv_pages == 40
        assert loop.sched.num_usable_pages == layout.dp_size * 39
        for rid in "abc":
            sp = SamplingParams(max_tokens=3 + (rid == "a"), ignore_eos=True)
            to_sched.send(GenerateRequest(rid, [1, 2, 3], sp))
        done: dict[str, list[int]] = {}
        for _ in range(200):
            loop.step()
            while (msg := from_sched.recv(0)) is not None:
                assert isinstance(msg, BatchOutput)
                for out in msg.outputs:
                    done.setdefault(out.rid, []).extend(out.token_ids)
            if not loop.sched.has_work() and len(done) == 3:
                break
        assert done == {"a": [7] * 4, "b": [7] * 3, "c": [7] * 3}
        assert loop.sched.num_free_pages == loop.sched.num_usable_pages
    finally:
        loop.to_workers.send_nowait(Shutdown())
        for t in ranks:
            t.join(RECV_MS / 1000)
        to_sched.close()
        from_sched.close()
    assert not any(t.is_alive() for t in ranks)
    # NOTE: after the joins: a rank that does not report may still be on the last plan
    # when the reporting rank's result has finished every request
    assert all(s == seen[0] for s in seen) and seen[0]  # every rank ran every plan
