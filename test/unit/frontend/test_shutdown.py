"""--shutdown-timeout: once uvicorn stops (SIGTERM, SIGINT), requests in flight get
that long to finish; those still running then end with an error the client reads (a
stream's error event and end), never a dropped connection."""

from __future__ import annotations

import asyncio
import json

import httpx

from gyrfalcon.frontend.server import drain_on_shutdown

from .frontend_fakes import LONG_REPLY_TOKENS, SLOW_S, USER, live_server, replying, run, slow_script


async def stream_across_shutdown(srv, timeout_s: float) -> list[str]:
    """Start a streamed chat, stop the server after its first chunk, with `timeout_s`
    to drain -> the stream's data lines."""
    drain = asyncio.create_task(drain_on_shutdown(srv.server, srv.engine, timeout_s))
    body = {"messages": USER, "stream": True, "max_tokens": 20}
    async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = []
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if len(lines) == 2:  # the role chunk, then a token: running
                        srv.server.should_exit = True
    await asyncio.wait_for(drain, 5)
    return lines


def test_requests_that_finish_within_the_timeout_finish_normally(tokenizer):
    async def body():
        # 20 tokens x SLOW_S: well within 10 s
        async with live_server(tokenizer, slow_script) as srv:
            lines = await stream_across_shutdown(srv, 10.0)
            assert lines[-1] == "data: [DONE]"
            last = json.loads(lines[-2][len("data: ") :])
            assert last["choices"][0]["finish_reason"] == "length"
            assert srv.engine.dead is None

    run(body)


def test_requests_still_running_at_the_timeout_end_with_an_error(tokenizer):
    assert len(LONG_REPLY_TOKENS) * SLOW_S > 1.0  # the script outlasts the timeout

    async def body():
        async with live_server(tokenizer, slow_script) as srv:
            t0 = asyncio.get_running_loop().time()
            body = {"messages": USER, "stream": True}  # NOTE: no max_tokens: the long reply
            drain = asyncio.create_task(drain_on_shutdown(srv.server, srv.engine, 0.3))
            async with httpx.AsyncClient(base_url=srv.url, timeout=30) as client:
                async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    lines = []
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            lines.append(line)
                            if len(lines) == 2:
                                srv.server.should_exit = True
            await asyncio.wait_for(drain, 5)
            assert asyncio.get_running_loop().time() - t0 < 0.3 + 1.0
            events = [json.loads(x[len("data: ") :]) for x in lines if x != "data: [DONE]"]
            assert "shutting down" in events[-1]["error"]["message"], events[-1]
            assert srv.engine.dead is not None  # later requests are refused

    run(body)


def test_an_idle_server_stops_at_once(tokenizer):
    async def body():
        async with live_server(tokenizer, replying(tokenizer)) as srv:
            drain = asyncio.create_task(drain_on_shutdown(srv.server, srv.engine, 30.0))
            srv.server.should_exit = True
            await asyncio.wait_for(drain, 1.0)
            assert srv.engine.dead is None

    run(body)
