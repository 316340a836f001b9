"""Load: 1,000 streamed requests at concurrency 256 on the shared SmolLM2 server. Every
request ends with its finish reason and usage, none is lost or duplicated, the
scheduler gives back every page (the `client` fixture checks), and the frontend's
memory settles instead of growing with the requests served."""

from __future__ import annotations

import asyncio

import httpx
from server_util import rss_kb

TOTAL, CONCURRENCY, WAVES = 1000, 256, 2
MAX_TOKENS = 4
RSS_GROWTH_LIMIT_KB = 20 * 1024  # the second half of the load over the first


async def streamed(client: httpx.AsyncClient, model: str, i: int) -> tuple[int, str, int]:
    body = {"model": model, "prompt": f"Request {i}:", "max_tokens": MAX_TOKENS, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0}  # fmt: skip
    finish, tokens = None, None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = httpx.Response(200, content=line[len("data: ") :]).json()
            for choice in chunk["choices"]:
                finish = choice["finish_reason"] or finish
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return i, finish, tokens


def test_1000_streams_at_concurrency_256_all_end_and_memory_settles(server, client, model_name):
    async def wave(offset: int) -> list[tuple[int, str, int]]:
        limiter = asyncio.Semaphore(CONCURRENCY)
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600, limits=limits) as c:

            async def one(i: int):
                async with limiter:
                    return await streamed(c, model_name, i)

            return await asyncio.gather(*(one(offset + i) for i in range(TOTAL // WAVES)))

    rss = []
    results = []
    for w in range(WAVES):
        results += asyncio.run(wave(w * TOTAL // WAVES))
        rss.append(rss_kb(server.proc.pid))
    assert sorted(i for i, _, _ in results) == list(range(TOTAL)), "lost or duplicated"
    assert all(finish in ("stop", "length") for _, finish, _ in results)
    assert all(1 <= tokens <= MAX_TOKENS for _, _, tokens in results)
    assert rss[-1] - rss[0] < RSS_GROWTH_LIMIT_KB, f"frontend RSS grew {rss} kB"
    assert server.info()["num_in_flight"] == 0
