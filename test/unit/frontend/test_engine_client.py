"""EngineClient over real ZMQ ipc sockets against the fake scheduler."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager

import pytest

from gyrfalcon.frontend.engine_client import EngineClient, EngineDeadError
from gyrfalcon.ipc.messages import GenerateRequest, SamplingParams
from gyrfalcon.ipc.sockets import IpcPaths

from .frontend_fakes import EOS_ID, MAX_MODEL_LEN, FakeScheduler, Script, run, wait_until

TOKENS = [10, 11, 12, 13, 14]
SLOW_S = 0.02
STATS_TIMEOUT_S = 5.0


@asynccontextmanager
async def connected(
    script_for: Callable[[GenerateRequest], Script], send_ready: bool = True
) -> AsyncIterator[tuple[FakeScheduler, EngineClient]]:
    paths, root = IpcPaths.create()
    scheduler = FakeScheduler(paths, script_for, send_ready=send_ready)
    await scheduler.start()
    engine = EngineClient(paths)
    await engine.start()
    try:
        yield scheduler, engine
    finally:
        engine.close()
        scheduler.close()
        shutil.rmtree(root, ignore_errors=True)


def test_ready_and_full_generation():
    async def body():
        async with connected(lambda r: Script(TOKENS, chunk=2)) as (sched, engine):
            await asyncio.wait_for(engine.ready.wait(), STATS_TIMEOUT_S)
            assert engine.info is not None and engine.info.max_model_len == MAX_MODEL_LEN
            outs = [o async for o in engine.generate("a", [1, 2], SamplingParams(max_tokens=50))]
            assert [t for o in outs for t in o.token_ids] == TOKENS + [EOS_ID]
            assert outs[-1].finish_reason == "stop"
            assert all(o.finish_reason is None for o in outs[:-1])
            assert engine.num_in_flight == 0
            assert sched.requests[0].prompt_ids == [1, 2] and sched.aborted == []

    run(body)


def test_not_ready_until_engine_ready():
    async def body():
        async with connected(lambda r: Script(TOKENS), send_ready=False) as (sched, engine):
            await asyncio.sleep(SLOW_S)
            assert not engine.ready.is_set() and engine.info is None
            await sched.ready()
            await asyncio.wait_for(engine.ready.wait(), STATS_TIMEOUT_S)

    run(body)


def test_consumer_leaving_early_aborts_the_request():
    async def body():
        slow = Script(list(range(100, 200)), delay_s=SLOW_S)
        async with connected(lambda r: slow) as (sched, engine):
            gen = engine.generate("early", [1], SamplingParams(max_tokens=100))
            async with aclosing(gen):
                first = await gen.__anext__()
                assert first.token_ids == [100]
            await wait_until(lambda: sched.aborted == ["early"])
            assert engine.num_in_flight == 0 and "early" not in sched.active

    run(body)


def test_cancelled_consumer_aborts_the_request():
    async def body():
        slow = Script(list(range(100, 200)), delay_s=SLOW_S)
        async with connected(lambda r: slow) as (sched, engine):

            async def consume():
                async for _ in engine.generate("cancel-me", [1], SamplingParams(max_tokens=100)):
                    pass

            task = asyncio.create_task(consume())
            await wait_until(lambda: "cancel-me" in sched.active)
            task.cancel()
            await wait_until(lambda: sched.aborted == ["cancel-me"])
            assert engine.num_in_flight == 0

    run(body)


def test_abort_gives_a_final_abort_output():
    async def body():
        slow = Script(list(range(100, 200)), delay_s=SLOW_S)
        async with connected(lambda r: slow) as (sched, engine):
            outs = []
            async for o in engine.generate("x", [1], SamplingParams(max_tokens=100)):
                outs.append(o)
                if len(outs) == 2:
                    await engine.abort("x")
            assert outs[-1].finish_reason == "abort" and sched.aborted == ["x"]

    run(body)


def test_duplicate_rid_is_refused():
    async def body():
        slow = Script(list(range(100, 200)), delay_s=SLOW_S)
        async with connected(lambda r: slow) as (_, engine):
            gen = engine.generate("dup", [1], SamplingParams(max_tokens=100))
            async with aclosing(gen):
                await gen.__anext__()
                with pytest.raises(ValueError):
                    await engine.generate("dup", [1], SamplingParams()).__anext__()

    run(body)


def test_stats_round_trip_and_timeout():
    async def body():
        async with connected(lambda r: Script(TOKENS)) as (sched, engine):
            reply = await engine.stats(timeout=STATS_TIMEOUT_S)
            assert reply.integrity_ok and reply.num_running == 0
            sched._loop.cancel()  # the scheduler stops answering
            with pytest.raises(TimeoutError):
                await engine.stats(timeout=SLOW_S)

    run(body)


def test_engine_error_fails_in_flight_requests_and_marks_dead():
    async def body():
        slow = Script(list(range(100, 200)), delay_s=SLOW_S)
        async with connected(lambda r: slow) as (sched, engine):
            outs = []
            async for o in engine.generate("doomed", [1], SamplingParams(max_tokens=100)):
                outs.append(o)
                if len(outs) == 1:
                    await sched.die("worker 0 crashed")
            assert outs[-1].finish_reason == "error" and outs[-1].error == "worker 0 crashed"
            assert engine.dead == "worker 0 crashed"
            with pytest.raises(EngineDeadError):
                await engine.generate("late", [1], SamplingParams()).__anext__()
            with pytest.raises(EngineDeadError):
                await engine.stats(timeout=STATS_TIMEOUT_S)

    run(body)


def test_merge_outputs_joins_tokens_and_keeps_the_later_state():
    from gyrfalcon.frontend.engine_client import merge_outputs
    from gyrfalcon.ipc.messages import PositionLogprobs, RequestOutput

    def lp(t: int) -> PositionLogprobs:
        return PositionLogprobs(t, -0.5, [])

    a = RequestOutput("r", [5, 6], [lp(5), lp(6)], [None, lp(1)], num_prompt_tokens=2,
                      num_output_tokens=2, num_verify_steps=1, num_accepted=1)  # fmt: skip
    b = RequestOutput("r", [7], [lp(7)], None, "length", 2, 3, num_verify_steps=2, num_accepted=1)
    m = merge_outputs(a, b)
    assert m.token_ids == [5, 6, 7] and [p.token_id for p in m.logprobs] == [5, 6, 7]
    assert m.prompt_logprobs == [None, lp(1)] and m.finish_reason == "length"
    assert (m.num_output_tokens, m.num_verify_steps, m.num_accepted) == (3, 2, 1)
    assert a.token_ids == [5, 6] and b.token_ids == [7]  # the inputs are left as they were
    plain = merge_outputs(RequestOutput("r", [1]), RequestOutput("r", [2], finish_reason="stop"))
    assert plain.logprobs is None and plain.token_ids == [1, 2]


def test_a_consumer_behind_the_engine_gets_the_queued_outputs_as_one():
    """A consumer that reads late takes every output queued for it as one (fewer SSE
    chunks under load), with the same tokens, logprobs and prompt logprobs in order
    and the finish only on the last; `observe` (the metrics) still sees each output
    as the engine sent it."""
    tokens = list(range(10, 50))
    sp = SamplingParams(max_tokens=100, logprobs=1, prompt_logprobs=0)

    async def body():
        async with connected(lambda r: Script(tokens, chunk=1)) as (sched, engine):
            await asyncio.wait_for(engine.ready.wait(), STATS_TIMEOUT_S)
            outs, seen = [], []
            async with aclosing(engine.generate("a", [1, 2, 3], sp, seen.append)) as gen:
                async for o in gen:
                    if not outs:
                        await asyncio.sleep(0.3)  # NOTE: the rest queue meanwhile
                    outs.append(o)
            got = [t for o in outs for t in o.token_ids]
            assert got == tokens + [EOS_ID] and len(outs) < len(got)
            assert [p.token_id for o in outs for p in o.logprobs] == got
            assert [o.prompt_logprobs is not None for o in outs] == [True] + [False] * (
                len(outs) - 1
            )
            assert [o.finish_reason for o in outs] == [None] * (len(outs) - 1) + ["stop"]
            assert outs[-1].num_output_tokens == len(got)
            assert [o.token_ids for o in seen] == [[t] for t in got]

    run(body)


def test_an_api_server_of_several_prefixes_its_rids_and_reads_its_own_socket():
    """--api-server-count 2, API server 1: its requests reach the scheduler as `1:rid`
    with its index, and the replies come on its own socket (the fake binds only it)."""

    async def body():
        paths, root = IpcPaths.create(num_frontends=2)
        own = dataclasses.replace(paths, scheduler_to_frontends=paths.scheduler_to_frontends[1:])
        sched = FakeScheduler(own, lambda r: Script(TOKENS, chunk=2))
        await sched.start()
        engine = EngineClient(paths, api_server=1)
        await engine.start()
        try:
            await asyncio.wait_for(engine.ready.wait(), STATS_TIMEOUT_S)
            outs = [o async for o in engine.generate("a", [1, 2], SamplingParams(max_tokens=50))]
            assert [t for o in outs for t in o.token_ids] == TOKENS + [EOS_ID]
            assert {o.rid for o in outs} == {"1:a"}
            (req,) = sched.requests
            assert (req.rid, req.api_server) == ("1:a", 1)
            assert (await engine.stats(STATS_TIMEOUT_S)).integrity_ok
            await engine.abort("b")
            await wait_until(lambda: sched.aborted == ["1:b"])
        finally:
            engine.close()
            sched.close()
            shutil.rmtree(root, ignore_errors=True)

    run(body)
