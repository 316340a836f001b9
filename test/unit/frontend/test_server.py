"""The HTTP app over a live uvicorn, the real EngineClient and a fake scheduler:
chat response shapes, streaming, fan-out, stop handling, the openai client."""

from __future__ import annotations

import httpx
import pytest

from .frontend_fakes import (
    EOS_ID,
    MAX_MODEL_LEN,
    MODEL_NAME,
    REPLY,
    SAMPLED_LOGPROB,
    SLOW_S,
    USER,
    chat_prompt_ids,
    live_server,
    post,
    replying,
    run,
    sse_events,
    wait_until,
)


def test_health_version_models(tokenizer):
    async def body():
        async with (
            live_server(tokenizer, replying(tokenizer), send_ready=False) as srv,
            httpx.AsyncClient(base_url=srv.url) as client,
        ):
            assert (await client.get("/health")).status_code == 503
            r = await post(srv.url, "/v1/chat/completions", {"messages": USER})
            assert r.status_code == 503 and r.json()["error"]["code"] == 503
            await srv.scheduler.ready()
            await wait_until(srv.engine.ready.is_set)
            assert (await client.get("/health")).status_code == 200
            assert (await client.get("/version")).json()["version"]
            models = (await client.get("/v1/models")).json()
            assert models["object"] == "list"
            card = models["data"][0]
            assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == (
                MODEL_NAME,
                "model",
                "gyrfalcon",
                MAX_MODEL_LEN,
            )
            info = (await client.get("/server_info")).json()
            assert info["integrity_ok"] and info["model"] == MODEL_NAME
            assert info["num_running"] == 0

    run(body)


def test_chat_non_streaming(tokenizer):
    async def body():
        async with live_server(tokenizer, replying(tokenizer)) as srv:
            r = await post(srv.url, "/v1/chat/completions", {"model": MODEL_NAME, "messages": USER})
            assert r.status_code == 200, r.text
            data = r.json()
            prompt = chat_prompt_ids(tokenizer, USER)
            assert srv.scheduler.requests[0].prompt_ids == prompt
            assert srv.scheduler.requests[0].sampling.max_tokens == MAX_MODEL_LEN - len(prompt)
            assert data["object"] == "chat.completion" and data["id"].startswith("chatcmpl-")
            choice = data["choices"][0]
            assert choice["message"] == {"role": "assistant", "content": REPLY}
            assert choice["finish_reason"] == "stop"  # EOS, counted but not rendered
            n_reply = len(tokenizer.encode(REPLY))
            assert data["usage"] == {
                "prompt_tokens": len(prompt),
                "completion_tokens": n_reply + 1,
                "total_tokens": len(prompt) + n_reply + 1,
            }

    run(body)


def test_max_tokens_and_stop_token_ids(tokenizer):
    async def body():
        async with live_server(tokenizer, replying(tokenizer)) as srv:
            r = await post(
                srv.url,
                "/v1/chat/completions",
                {"messages": USER, "max_completion_tokens": 3, "max_tokens": 50},
            )
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "length"
            assert choice["message"]["content"] == tokenizer.decode(tokenizer.encode(REPLY)[:3])
            assert r.json()["usage"]["completion_tokens"] == 3
            comma = tokenizer.encode(",")[0]
            r = await post(
                srv.url, "/v1/chat/completions", {"messages": USER, "stop_token_ids": [comma]}
            )
            choice = r.json()["choices"][0]
            assert (choice["message"]["content"], choice["finish_reason"]) == (
                "Hello world",
                "stop",
            )
            assert srv.scheduler.requests[1].sampling.stop_token_ids == [comma]

    run(body)


def test_stop_string_truncates_and_aborts_the_engine_request(tokenizer):
    async def body():
        script = replying(tokenizer, REPLY + " and on" * 50, delay_s=SLOW_S / 4)
        async with live_server(tokenizer, script) as srv:
            r = await post(
                srv.url, "/v1/chat/completions", {"messages": USER, "stop": ["nothing", "is 😀"]}
            )
            choice = r.json()["choices"][0]
            assert (choice["message"]["content"], choice["finish_reason"]) == (
                "Hello world, this ",
                "stop",
            )
            rid = srv.scheduler.requests[0].rid
            await wait_until(lambda: srv.scheduler.aborted == [rid])
            assert r.json()["usage"]["completion_tokens"] < 20

    run(body)


def test_n_fanout_seeds_and_usage(tokenizer):
    async def body():
        async with live_server(tokenizer, replying(tokenizer)) as srv:
            r = await post(
                srv.url,
                "/v1/chat/completions",
                {"messages": USER, "n": 3, "seed": 11, "max_tokens": 4},
            )
            data = r.json()
            assert [c["index"] for c in data["choices"]] == [0, 1, 2]
            reqs = sorted(srv.scheduler.requests, key=lambda q: q.rid)
            assert [q.rid for q in reqs] == [f"{data['id']}-{i}" for i in range(3)]
            assert [q.sampling.seed for q in reqs] == [11, 12, 13]
            prompt_len = len(chat_prompt_ids(tokenizer, USER))
            assert data["usage"]["prompt_tokens"] == prompt_len  # counted once
            assert data["usage"]["completion_tokens"] == 3 * 4

    run(body)


def test_chat_streaming_with_logprobs_and_usage(tokenizer):
    async def body():
        async with live_server(tokenizer, replying(tokenizer, chunk=2)) as srv:
            r = await post(
                srv.url,
                "/v1/chat/completions",
                {
                    "messages": USER,
                    "stream": True,
                    "n": 2,
                    "logprobs": True,
                    "top_logprobs": 2,
                    "stream_options": {"include_usage": True},
                },
            )
            assert r.headers["content-type"].startswith("text/event-stream")
            chunks = sse_events(r.text)
            assert all(c["object"] == "chat.completion.chunk" for c in chunks)
            for i in range(2):
                mine = [
                    c["choices"][0]
                    for c in chunks
                    if c["choices"] and c["choices"][0]["index"] == i
                ]
                assert mine[0]["delta"] == {"role": "assistant", "content": ""}
                assert "".join(m["delta"].get("content") or "" for m in mine) == REPLY
                assert [m["finish_reason"] for m in mine][-1] == "stop"
                assert all(m["finish_reason"] is None for m in mine[:-1])
                tokens = [e for m in mine if m["logprobs"] for e in m["logprobs"]["content"]]
                reply_ids = tokenizer.encode(REPLY)
                # one entry per counted token: the EOS keeps its entry, not its text
                assert len(tokens) == len(reply_ids) + 1
                assert tokens[-1]["token"] == "<|im_end|>"
                assert bytes(b for e in tokens[:-1] for b in e["bytes"]).decode() == REPLY
                assert tokens[0]["logprob"] == SAMPLED_LOGPROB
                assert len(tokens[0]["top_logprobs"]) == 2
            usage = chunks[-1]
            assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 2 * (
                len(tokenizer.encode(REPLY)) + 1
            )

    run(body)


def test_official_openai_client(tokenizer):
    import openai

    async def body():
        async with live_server(tokenizer, replying(tokenizer)) as srv:
            client = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="none")
            resp = await client.chat.completions.create(model=MODEL_NAME, messages=USER)
            assert resp.choices[0].message.content == REPLY
            stream = await client.chat.completions.create(
                model=MODEL_NAME, messages=USER, stream=True, stream_options={"include_usage": True}
            )
            parts, usage = [], None
            async for chunk in stream:
                parts += [c.delta.content or "" for c in chunk.choices]
                usage = chunk.usage or usage
            assert "".join(parts) == REPLY and usage is not None
            comp = await client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
            assert comp.choices[0].finish_reason == "length"
            with pytest.raises(openai.NotFoundError):
                await client.chat.completions.create(model="other", messages=USER)
            with pytest.raises(openai.BadRequestError):
                await client.chat.completions.create(model=MODEL_NAME, messages=USER, n=0)
            await client.close()

    run(body)


def test_eos_constant_matches_tokenizer(tokenizer):
    assert tokenizer.convert_ids_to_tokens(EOS_ID) == "<|im_end|>"
