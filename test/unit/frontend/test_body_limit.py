"""--max-request-body-bytes: a body over the limit gets OpenAI's 400 before anything
parses it, declared (Content-Length) or streamed (chunked); bodies within it serve."""

from __future__ import annotations

import json

import httpx

from .frontend_fakes import USER, live_server, replying, run

LIMIT = 2048


def test_bodies_over_the_limit_get_400_and_the_server_keeps_serving(tokenizer):
    small = {"messages": USER, "max_tokens": 2}
    big = {"messages": [{"role": "user", "content": "x" * (2 * LIMIT)}], "max_tokens": 2}

    async def chunked(payload):  # NOTE: a generator body: httpx sends it chunked, no length
        data = json.dumps(payload).encode()
        for i in range(0, len(data), 512):
            yield data[i : i + 512]

    async def body():
        async with live_server(tokenizer, replying(tokenizer), max_body_bytes=LIMIT) as srv:
            async with httpx.AsyncClient(base_url=srv.url, timeout=10) as client:
                headers = {"content-type": "application/json"}
                for content in (json.dumps(big).encode(), chunked(big)):
                    r = await client.post("/v1/chat/completions", content=content, headers=headers)
                    assert r.status_code == 400, r.text
                    err = r.json()["error"]
                    assert err["code"] == 400 and "--max-request-body-bytes" in err["message"]
                assert srv.scheduler.requests == [], "an oversized body reached the engine"
                for content in (json.dumps(small).encode(), chunked(small)):
                    r = await client.post("/v1/chat/completions", content=content, headers=headers)
                    assert r.status_code == 200, r.text
                assert len(srv.scheduler.requests) == 2

    run(body)
