"""schemathesis against /openapi.json: generated chat, completion and tokenizer
requests, valid and invalid, never get a 5xx, and the server stays healthy. The engine is the fake
scheduler (frontend_fakes.py): the frontend's validation is what is attacked."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402

from .frontend_fakes import live_server, replying  # noqa: E402

EXAMPLES = 40  # per operation: bounded so CI stays fast


@pytest.fixture(scope="module")
def fuzz_url(tokenizer):
    """A live server in a thread of its own (schemathesis calls are synchronous)."""
    ready = threading.Event()
    state: dict = {}

    def serve() -> None:
        async def main() -> None:
            async with live_server(tokenizer, replying(tokenizer)) as srv:
                state["url"], state["loop"] = srv.url, asyncio.get_running_loop()
                state["stop"] = asyncio.Event()
                ready.set()
                await state["stop"].wait()

        asyncio.run(main())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(60), "the fuzzing server did not start"
    yield state["url"]
    assert httpx.get(f"{state['url']}/health", timeout=10).status_code == 200, "unhealthy after"
    state["loop"].call_soon_threadsafe(state["stop"].set)
    thread.join(30)


@pytest.mark.parametrize(
    "path", ["/v1/completions", "/v1/chat/completions", "/v1/tokenize", "/v1/detokenize"]
)
def test_generated_requests_never_get_a_server_error(fuzz_url, path):
    schema = schemathesis.openapi.from_url(f"{fuzz_url}/openapi.json")
    operation = schema[path]["POST"]

    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES, deadline=None, database=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    def check(case):
        response = case.call(base_url=fuzz_url, timeout=30)
        assert response.status_code < 500, (case.body, response.status_code, response.text[:500])
        if response.status_code >= 400:
            assert "error" in response.json(), response.text[:500]  # OpenAI-shaped

    check()
