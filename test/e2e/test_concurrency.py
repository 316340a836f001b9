"""Many concurrent streams and client disconnects: every request ends, every page returns."""

import asyncio
import time

import httpx


def test_64_concurrent_streams(server, client, model_name):
    from openai import AsyncOpenAI

    async def run():
        ac = AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=600
        )

        async def one(i):
            stream = await ac.chat.completions.create(
                model=model_name,
                messages=[{"role": "user", "content": f"Count from {i} to {i + 5}."}],
                temperature=0,
                max_tokens=16,
                stream=True,
                stream_options={"include_usage": True},
            )
            text, usage = "", None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                if chunk.usage:
                    usage = chunk.usage
            return text, usage

        results = await asyncio.gather(*(one(i) for i in range(64)))
        await ac.close()
        return results

    results = asyncio.run(run())
    assert len(results) == 64
    for text, usage in results:
        assert text and usage is not None and 1 <= usage.completion_tokens <= 16
    # batched greedy == alone greedy
    alone = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Count from 3 to 8."}],
        temperature=0,
        max_tokens=16,
    )
    assert results[3][0] == alone.choices[0].message.content


def test_disconnect_mid_stream_aborts_and_frees_pages(server, client, model_name):
    body = {
        "model": model_name,
        "prompt": "Once upon a time",
        "max_tokens": 2000,
        "stream": True,
        "ignore_eos": True,
    }
    for _ in range(3):
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            lines = 0
            for line in r.iter_lines():
                if line.startswith("data:"):
                    lines += 1
                if lines >= 3:
                    break  # leaving the block closes the connection
    time.sleep(0.5)
    info = server.info()
    deadline = time.time() + 30
    while info["num_running"] and time.time() < deadline:
        time.sleep(0.2)
        info = server.info()
    assert info["num_running"] == 0, "disconnected requests kept running"
    assert info["num_free_pages"] == info["num_total_pages"]


def test_disconnect_non_streaming_aborts(server, client, model_name):
    body = {
        "model": model_name,
        "prompt": "Once upon a time",
        "max_tokens": 3000,
        "ignore_eos": True,
    }
    try:
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=1.5)
    except httpx.TimeoutException:
        pass
    deadline = time.time() + 30
    info = server.info()
    while info["num_running"] and time.time() < deadline:
        time.sleep(0.2)
        info = server.info()
    assert info["num_running"] == 0, "abandoned request kept running"


def test_the_server_streams_on_uvloop_and_httptools(server):
    """Both are dependencies: a server that fell back to asyncio's loop or the pure-Python
    h11 spends ~12% more of its one frontend core a streamed token (benchmarks/NOTES.md)."""
    info = server.info()
    assert (info["event_loop"], info["http"]) == ("uvloop", "httptools"), info
    assert "HTTP through httptools on uvloop's event loop" in server.log()
