"""EngineClient over real ZMQ ipc sockets against the fake scheduler."""

from __future__ import annotations

import asyncio
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
