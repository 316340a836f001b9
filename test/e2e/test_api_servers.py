"""--api-server-count 2: two HTTP frontends share the port and the one scheduler."""

import asyncio
import collections
import json
import os
import re
import signal
import subprocess
import time

import httpx
from server_util import alive, children_of, start_server, stop_server, wait_drained

# NOTE: a small KV pool, as the shared e2e server's; a drain that cannot time out on a
# slow machine (two 100-token streams took 24 s of the default 30 on two cores)
FLAGS = (
    "--num-kv-pages", "512", "--page-size", "16", "--api-server-count", "2",
    "--shutdown-timeout", "300",
)  # fmt: skip
SERVING_LINE = "API server 1: HTTP on"
LOG_WAIT_S = 60
NUM_STREAMS = 32
MAX_TOKENS = 8
PIN_ATTEMPTS = 200  # new connections tried to reach a given API server
DRAIN_TOKENS = 40  # a stream still running when the SIGTERM comes
DRAIN_WAIT_S = 60


def comm(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f.read().strip()


def wait_for_log(server, text: str) -> None:
    """Until the server's log holds `text` (API server 1 logs it once it listens)."""
    deadline = time.monotonic() + LOG_WAIT_S
    while text not in server.log():
        assert time.monotonic() < deadline, f"no {text!r} in the log:\n{server.log()[-3000:]}"
        assert server.proc.poll() is None, server.log()[-3000:]
        time.sleep(0.1)


async def one_stream(url: str, i: int) -> tuple[int, int]:
    """A streamed completion on a connection of its own: (text chunks, completion tokens)."""
    body = {
        "prompt": f"Count from {i}:", "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    chunks, usage = 0, None
    async with httpx.AsyncClient(timeout=300) as client:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                chunks += len(event["choices"])
                usage = event.get("usage") or usage
    assert usage is not None
    return chunks, usage["completion_tokens"]


def requests_by_process(log: str) -> collections.Counter:
    """Requests that ended, by the process that logged them (--log-requests)."""
    ends = re.findall(rf"\[([\w-]+)\] INFO \S+: request \S+: length, {MAX_TOKENS} tokens", log)
    return collections.Counter(ends)


def success_count(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(r'^gyrfalcon:request_success_total\{[^}]*"length"[^}]*\} (\S+)$', text, re.M)
    assert found, text
    return float(found[1])


async def pinned_client(url: str, api_server: int) -> httpx.AsyncClient:
    """A client whose one keep-alive connection API server `api_server` took."""
    for _ in range(PIN_ATTEMPTS):
        client = httpx.AsyncClient(
            base_url=url, timeout=300, limits=httpx.Limits(max_connections=1)
        )
        if (await client.get("/server_info")).json()["api_server"] == api_server:
            return client
        await client.aclose()
    raise AssertionError(f"no connection reached API server {api_server}")


async def stream_on(client: httpx.AsyncClient, max_tokens: int) -> list[str]:
    body = {
        "prompt": "Once", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }  # fmt: skip
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        return [line async for line in r.aiter_lines() if line.startswith("data: ")]


async def sigterm_while_both_stream(srv) -> list[list[str]]:
    """A stream on each API server, SIGTERM to the launcher once both run: what each
    stream got."""
    pinned = [await pinned_client(srv.base_url, i) for i in (0, 1)]
    streams = [asyncio.create_task(stream_on(c, DRAIN_TOKENS)) for c in pinned]
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=30) as probe:
        deadline = time.monotonic() + LOG_WAIT_S
        while (await probe.get("/server_info")).json()["num_running"] < 2:
            assert time.monotonic() < deadline, "the two streams never ran together"
            await asyncio.sleep(0.05)
    srv.proc.send_signal(signal.SIGTERM)
    try:
        return await asyncio.gather(*streams)
    finally:
        for c in pinned:
            await c.aclose()


def test_two_api_servers_serve_one_port_and_stop_together(smollm2_dir, tmp_path):
    srv = start_server(smollm2_dir, str(tmp_path / "log"), *FLAGS, "--log-requests")
    kids = children_of(srv.proc.pid)
    try:
        assert "gyr-api-server1" in {comm(k) for k in kids}
        wait_for_log(srv, SERVING_LINE)

        async def streams():
            return await asyncio.gather(*(one_stream(srv.base_url, i) for i in range(NUM_STREAMS)))

        results = asyncio.run(streams())
        assert all(tokens == MAX_TOKENS for _, tokens in results), results
        assert all(chunks >= 1 for chunks, _ in results), results
        info = wait_drained(srv)
        assert info["integrity_ok"], info  # NOTE: also the scheduler's routes per API server
        assert info["num_free_pages"] == info["num_total_pages"], info
        assert info["num_running"] == info["num_waiting"] == 0, info
        served = requests_by_process(srv.log())
        assert set(served) == {"main", "api-server1"} and sum(served.values()) == NUM_STREAMS
        # NOTE: each scrape on a new connection, answered by either API server: the sum
        seen = set()
        for _ in range(8):
            assert success_count(srv.base_url) == NUM_STREAMS
            seen.add(httpx.get(f"{srv.base_url}/server_info", timeout=30).json()["api_server"])
        assert seen <= {0, 1}
        # NOTE: both API servers drain: each stream ends whole after the SIGTERM
        for lines in asyncio.run(sigterm_while_both_stream(srv)):
            assert lines[-1] == "data: [DONE]", lines[-3:]
            usage = json.loads(lines[-2][len("data: ") :]).get("usage")
            assert usage is not None, (lines[-3:], srv.log()[-3000:])
            assert usage["completion_tokens"] == DRAIN_TOKENS, lines[-3:]
        code = srv.proc.wait(DRAIN_WAIT_S)
    finally:
        stop_server(srv)
    assert code == 0, srv.log()[-3000:]
    log = srv.log()
    assert "API server 1 stopped" in log and "server stopped" in log
    # NOTE: every process froze its start-up heap once serving and counted its collections
    for who in ("API server 0: gc: ", "API server 1: gc: ", "scheduler: gc: ", "; gc: "):
        assert who in log, f"no line {who!r} in the log"
    time.sleep(0.5)
    assert not [k for k in kids if alive(k)], "child processes outlived the server"


def test_a_killed_api_server_takes_the_server_down(smollm2_dir, tmp_path):
    srv = start_server(smollm2_dir, str(tmp_path / "log"), *FLAGS)
    kids = children_of(srv.proc.pid)
    try:
        (victim,) = [k for k in kids if comm(k) == "gyr-api-server1"]
        os.kill(victim, signal.SIGKILL)
        try:
            code = srv.proc.wait(30)
        except subprocess.TimeoutExpired:
            code = None
    finally:
        stop_server(srv)
    assert code not in (None, 0), srv.log()[-3000:]
    assert "api-server1 exited unexpectedly" in srv.log()
    time.sleep(0.5)
    assert not [k for k in kids if alive(k)], "child processes outlived the server"
