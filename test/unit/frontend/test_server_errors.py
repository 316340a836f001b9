"""Errors and failure paths over a live server: OpenAI-shaped 4xx/503, client
disconnects (the engine requests must be aborted), engine rejection and death."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from .frontend_fakes import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    USER,
    Script,
    live_server,
    post,
    rejecting_script,
    replying,
    run,
    slow_script,
    sse_events,
    wait_until,
)


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/chat/completions", "{not json", 400, None),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": USER, "temperature": 3}, 400, "temperature"),
        ("/v1/chat/completions", {"messages": USER, "n": 0}, 400, "n"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "bot", "content": "x"}]},
            400,
            "messages[0].role",
        ),
        ("/v1/chat/completions", {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs"),
        ("/v1/chat/completions", {"messages": USER, "model": "gpt-9"}, 404, "model"),
        (
            "/v1/chat/completions",
            {"messages": USER, "max_tokens": MAX_MODEL_LEN},
            400,
            "max_tokens",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "stop_token_ids": [10**9]},
            400,
            "stop_token_ids",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "word " * MAX_MODEL_LEN}]},
            400,
            "messages",
        ),
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
        ("/v1/completions", {"prompt": [1, 10**9]}, 400, "prompt"),
        ("/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": list(range(MAX_MODEL_LEN))}, 400, "prompt"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
        ("/v1/nothing", {}, 404, None),
        # a lone surrogate: valid JSON, invalid Unicode (was a 500)
        (
            "/v1/chat/completions",
            r'{"messages": [{"role": "user", "content": "a\ud800"}]}',
            400,
            "messages[0].content",
        ),
        ("/v1/completions", r'{"prompt": "\udfff"}', 400, "prompt"),
        # wrong JSON types (were coerced)
        ("/v1/chat/completions", {"messages": USER, "max_tokens": "8"}, 400, "max_tokens"),
        ("/v1/chat/completions", {"messages": USER, "max_tokens": True}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "hi", "temperature": "0"}, 400, "temperature"),
        ("/v1/completions", {"prompt": "hi", "stream": "false"}, 400, "stream"),
        # a structured-output spec xgrammar refuses (test_structured_output_protocol.py)
        (
            "/v1/chat/completions",
            {
                "messages": USER,
                "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 1}}},
            },
            400,
            "response_format",
        ),
        # tools: malformed, or with no --tool-call-parser (test_server_tools.py for more)
        (
            "/v1/chat/completions",
            {"messages": USER, "tools": [{"type": "function"}]},
            400,
            "tools[0].function",
        ),
        (
            "/v1/chat/completions",
            {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]},
            400,
            "tools",
        ),
        ("/v1/chat/completions", {"messages": USER, "tool_choice": "required"}, 400, "tool_choice"),
        (
            "/v1/chat/completions",
            {"messages": USER, "functions": [{"name": "f"}]},
            400,
            "functions",
        ),
        ("/v1/completions", {"prompt": "hi", "regex": "(a+"}, 400, "regex"),
        ("/v1/completions", {"prompt": "hi", "structured_outputs": {}}, 400, "structured_outputs"),
        ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, 400, "use_beam_search"),
        # token ids of the new sampling fields are checked against the vocabulary
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999999": 1}}, 400, "logit_bias"),
        (
            "/v1/completions",
            {"prompt": "hi", "allowed_token_ids": [1, 10**9]},
            400,
            "allowed_token_ids",
        ),
        ("/v1/completions", {"prompt": "hi", "stop": "x" * 5000}, 400, "stop"),
    ],
)
def test_bad_requests_get_openai_errors(tokenizer, path, body, status, param):
    async def run_it():
        async with live_server(tokenizer, replying(tokenizer)) as srv:
            r = await post(srv.url, path, body)
            assert r.status_code == status, r.text
            err = r.json()["error"]
            assert err["code"] == status and err["message"]
            assert err["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
            assert err["param"] == param
            assert srv.scheduler.requests == []

    run(run_it)


def test_streaming_client_disconnect_aborts(tokenizer):
    async def body():
        async with live_server(tokenizer, slow_script) as srv:
            async with (
                httpx.AsyncClient(base_url=srv.url) as client,
                client.stream(
                    "POST", "/v1/chat/completions", json={"messages": USER, "stream": True, "n": 2}
                ) as r,
            ):
                async for line in r.aiter_lines():
                    if '"content":"' in line and '"content":""' not in line:
                        break
            rids = {q.rid for q in srv.scheduler.requests}
            await wait_until(lambda: set(srv.scheduler.aborted) == rids)
            await wait_until(lambda: srv.engine.num_in_flight == 0)
            assert srv.scheduler.active == {}

    run(body)


def test_non_streaming_client_disconnect_aborts(tokenizer):
    async def body():
        async with live_server(tokenizer, slow_script) as srv:
            client_task = asyncio.create_task(
                post(srv.url, "/v1/completions", {"prompt": "hi", "max_tokens": 90})
            )
            await wait_until(lambda: len(srv.scheduler.active) == 1)
            client_task.cancel()
            rid = srv.scheduler.requests[0].rid
            await wait_until(lambda: srv.scheduler.aborted == [rid])
            await wait_until(lambda: srv.engine.num_in_flight == 0)

    run(body)


def test_engine_rejection_and_death(tokenizer):
    async def body():
        async with live_server(tokenizer, rejecting_script) as srv:
            r = await post(srv.url, "/v1/chat/completions", {"messages": USER})
            assert r.status_code == 400 and "too big" in r.json()["error"]["message"]
            r = await post(srv.url, "/v1/chat/completions", {"messages": USER, "stream": True})
            events = sse_events(r.text)
            assert "too big" in events[-1]["error"]["message"]
            await srv.scheduler.die("worker exited")
            await wait_until(lambda: srv.engine.dead is not None)
            async with httpx.AsyncClient(base_url=srv.url) as client:
                assert (await client.get("/health")).status_code == 503
            r = await post(srv.url, "/v1/completions", {"prompt": "hi"})
            assert r.status_code == 503 and "worker exited" in r.json()["error"]["message"]

    run(body)


def test_unknown_fields_are_ignored_with_one_log_line(tokenizer, caplog):
    async def run_it():
        async with live_server(tokenizer, replying(tokenizer)) as srv:
            body = {"messages": [{**USER[0], "mood": "x"}], "frobnicate": 1, "user": "u"}
            r = await post(srv.url, "/v1/chat/completions", body)
            assert r.status_code == 200, r.text
            r = await post(srv.url, "/v1/chat/completions", {"messages": USER, "user": "u"})
            assert r.status_code == 200, r.text

    with caplog.at_level("WARNING", logger="gyrfalcon.frontend.serving_common"):
        run(run_it)
    lines = [r.getMessage() for r in caplog.records if "ignoring fields" in r.getMessage()]
    # one line for the first request, naming both; none for the second (`user` is OpenAI's)
    assert lines == [
        "/v1/chat/completions: ignoring fields no API defines: frobnicate, messages[0].mood"
    ]


def test_a_full_engine_answers_503_with_retry_after(tokenizer):
    """The scheduler refuses arrivals beyond --max-queue-len (error_status 503): the
    client gets 503 with Retry-After, OpenAI-shaped; the server goes on serving."""
    import openai

    from gyrfalcon.frontend.serving_common import RETRY_AFTER_S

    full = "the server is full (2 requests waiting, --max-queue-len); retry later"
    refusing = lambda req: Script([], finish="error", error=full, error_status=503)  # noqa: E731

    async def body():
        async with live_server(tokenizer, refusing) as srv:
            for path, payload in (
                ("/v1/chat/completions", {"messages": USER}),
                ("/v1/completions", {"prompt": "hi"}),
            ):
                r = await post(srv.url, path, payload)
                assert r.status_code == 503, r.text
                assert r.headers["retry-after"] == str(RETRY_AFTER_S)
                err = r.json()["error"]
                assert err["code"] == 503 and "--max-queue-len" in err["message"]
            client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.InternalServerError) as exc:
                await client.chat.completions.create(model=MODEL_NAME, messages=USER)
            assert exc.value.status_code == 503
            await client.close()
            assert (await post(srv.url, "/v1/tokenize", {"prompt": "hi"})).status_code == 200

    run(body)


def test_request_timeout_aborts_the_request_with_504(tokenizer):
    """--request-timeout: a request still running then is aborted in the engine; a
    plain one gets 504, a stream an error event; quick requests are untouched."""

    async def body():
        async with live_server(tokenizer, slow_script, request_timeout=0.3) as srv:
            t0 = asyncio.get_running_loop().time()
            r = await post(srv.url, "/v1/chat/completions", {"messages": USER})
            assert r.status_code == 504, r.text
            assert "--request-timeout" in r.json()["error"]["message"]
            assert asyncio.get_running_loop().time() - t0 < 2.0
            await wait_until(lambda: len(srv.scheduler.aborted) == 1)
            r = await post(srv.url, "/v1/chat/completions", {"messages": USER, "stream": True})
            events = sse_events(r.text)
            assert "--request-timeout" in events[-1]["error"]["message"]
            await wait_until(lambda: len(srv.scheduler.aborted) == 2)
            r = await post(srv.url, "/v1/completions", {"prompt": "hi", "max_tokens": 3})
            assert r.status_code == 200  # 3 tokens x SLOW_S: within the limit

    run(body)
