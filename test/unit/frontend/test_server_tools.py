"""Function calling over HTTP (live uvicorn, real EngineClient, fake scheduler):
the fake engine "generates" a Hermes tool call; the official openai client reads
it back, streamed and not; tools and tool calls reach the chat template; bad
tool requests get OpenAI-shaped 400s."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from .frontend_fakes import MODEL_NAME, USER, live_server, post, replying, run, sse_events

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
CALLS_TEXT = (
    "Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
)
EXPECTED = [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]


def client_for(url: str):
    import openai

    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)


def calls_of(message: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


async def streamed(client: Any, **kw: Any) -> dict[int, dict[str, Any]]:
    """Per choice: the content, the calls rebuilt from the deltas, the finish reason."""
    out: dict[int, dict[str, Any]] = {}
    stream = await client.chat.completions.create(model=MODEL_NAME, stream=True, **kw)
    async for chunk in stream:
        for choice in chunk.choices:
            got = out.setdefault(choice.index, {"content": "", "calls": {}, "finish": None})
            got["content"] += choice.delta.content or ""
            assert "<tool_call>" not in (choice.delta.content or "")
            for call in choice.delta.tool_calls or []:
                if call.id is not None:  # the first delta of a call
                    assert call.id.startswith("call_") and call.type == "function"
                    got["calls"][call.index] = [call.function.name, ""]
                if call.function.arguments:
                    got["calls"][call.index][1] += call.function.arguments
            got["finish"] = choice.finish_reason or got["finish"]
    for got in out.values():
        got["calls"] = [(n, json.loads(a)) for _, (n, a) in sorted(got["calls"].items())]
    return out


def test_openai_client_reads_tool_calls(tokenizer):
    async def body():
        async with live_server(
            tokenizer, replying(tokenizer, CALLS_TEXT), tool_call_parser="hermes"
        ) as srv:
            client = client_for(srv.url)
            msgs = [{"role": "user", "content": "weather and time in Paris?"}]
            resp = await client.chat.completions.create(
                model=MODEL_NAME, messages=msgs, tools=TOOLS
            )
            choice = resp.choices[0]
            assert calls_of(choice.message) == EXPECTED
            assert choice.message.content == "Let me check."
            assert choice.finish_reason == "tool_calls"
            ids = [c.id for c in choice.message.tool_calls]
            assert all(i.startswith("call_") for i in ids) and len(set(ids)) == 2
            # usage counts the generated tokens, EOS included, as without tools
            assert resp.usage.completion_tokens == len(tokenizer.encode(CALLS_TEXT)) + 1

            got = await streamed(client, messages=msgs, tools=TOOLS)
            assert got == {
                0: {"content": "Let me check.", "calls": EXPECTED, "finish": "tool_calls"}
            }

            # n > 1: every choice parsed on its own; parallel_tool_calls false: the first call
            resp = await client.chat.completions.create(
                model=MODEL_NAME, messages=msgs, tools=TOOLS, n=2, parallel_tool_calls=False
            )
            assert [calls_of(c.message) for c in resp.choices] == [EXPECTED[:1]] * 2
            got = await streamed(client, messages=msgs, tools=TOOLS, n=2, parallel_tool_calls=False)
            assert [got[i]["calls"] for i in (0, 1)] == [EXPECTED[:1]] * 2
            await client.close()

    run(body)


def test_tool_choice_none_named_and_plain_answers(tokenizer):
    async def body():
        answers = {"json": '{"city": "Oslo"}', "plain": "It is sunny.", "calls": CALLS_TEXT}

        def script(req):
            text = tokenizer.decode(req.prompt_ids)
            key = next(k for k in answers if f"ask-{k}" in text)
            return replying(tokenizer, answers[key])(req)

        async with live_server(tokenizer, script, tool_call_parser="hermes") as srv:
            client = client_for(srv.url)

            def ask(key: str) -> list[dict[str, str]]:
                return [{"role": "user", "content": f"ask-{key}"}]

            # "none": no parsing, the model's text as it is
            resp = await client.chat.completions.create(
                model=MODEL_NAME, messages=ask("calls"), tools=TOOLS, tool_choice="none"
            )
            assert resp.choices[0].message.content == CALLS_TEXT
            assert not resp.choices[0].message.tool_calls
            assert resp.choices[0].finish_reason == "stop"
            # a plain answer to tools ("required": not the JSON its grammar forces): content,
            # no calls, "stop"
            for kw in ({}, {"tool_choice": "required"}):
                resp = await client.chat.completions.create(
                    model=MODEL_NAME, messages=ask("plain"), tools=TOOLS, **kw
                )
                assert resp.choices[0].message.content == "It is sunny."
                assert not resp.choices[0].message.tool_calls
                assert resp.choices[0].finish_reason == "stop"
            # a named function (forced by a grammar the fake engine ignores): the output,
            # a JSON object, is its arguments
            named = {"type": "function", "function": {"name": "get_weather"}}
            resp = await client.chat.completions.create(
                model=MODEL_NAME, messages=ask("json"), tools=TOOLS, tool_choice=named
            )
            assert calls_of(resp.choices[0].message) == [("get_weather", {"city": "Oslo"})]
            assert resp.choices[0].message.content is None
            got = await streamed(client, messages=ask("json"), tools=TOOLS, tool_choice=named)
            assert got[0]["calls"] == [("get_weather", {"city": "Oslo"})]
            # ... and no parser reads it: an output that is not that JSON is content
            named = {"type": "function", "function": {"name": "get_time"}}
            resp = await client.chat.completions.create(
                model=MODEL_NAME, messages=ask("calls"), tools=TOOLS, tool_choice=named
            )
            assert resp.choices[0].message.content == CALLS_TEXT
            assert not resp.choices[0].message.tool_calls
            assert resp.choices[0].finish_reason == "stop"
            await client.close()

    run(body)


def test_streamed_logprobs_keep_one_entry_per_token(tokenizer):
    async def body():
        async with live_server(
            tokenizer, replying(tokenizer, CALLS_TEXT), tool_call_parser="hermes"
        ) as srv:
            r = await post(
                srv.url,
                "/v1/chat/completions",
                {"messages": USER, "tools": TOOLS, "stream": True, "logprobs": True},
            )
            events = sse_events(r.text)
            entries = [
                e
                for ev in events
                for c in ev["choices"]
                for e in (c["logprobs"] or {}).get("content") or []
            ]
            assert len(entries) == len(tokenizer.encode(CALLS_TEXT)) + 1
            finishes = [c["finish_reason"] for ev in events for c in ev["choices"]]
            assert [f for f in finishes if f] == ["tool_calls"]

    run(body)


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %} {{ t.function.name }}="
    "{{ t.function.parameters | tojson }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.id }} {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}"
    "{% if m.tool_call_id %}RESULT-OF {{ m.tool_call_id }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tools_and_tool_messages_reach_the_chat_template(tokenizer):
    tok = copy.deepcopy(tokenizer)
    tok.chat_template = TOOL_TEMPLATE
    messages = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
    ]

    async def body():
        async with live_server(tok, replying(tok, "It is 22C."), tool_call_parser="hermes") as srv:
            client = client_for(srv.url)
            resp = await client.chat.completions.create(
                model=MODEL_NAME, messages=messages, tools=TOOLS
            )
            assert resp.choices[0].message.content == "It is 22C."
            prompt = tok.decode(srv.scheduler.requests[0].prompt_ids)
            params = json.dumps(WEATHER_TOOL["function"]["parameters"])
            no_params = json.dumps({"type": "object", "properties": {}})  # OpenAI's meaning
            assert prompt.startswith(f"TOOLS: get_weather={params} get_time={no_params}\n")
            # the arguments reach the template as an object, not a JSON string
            assert 'CALL call_1 get_weather {"city": "Paris"}<|im_end|>' in prompt
            assert "<|im_start|>tool\n22CRESULT-OF call_1<|im_end|>" in prompt
            # /tokenize renders the same prompt
            r = await post(srv.url, "/tokenize", {"messages": messages, "tools": TOOLS})
            assert r.json()["tokens"] == srv.scheduler.requests[0].prompt_ids
            await client.close()

    run(body)


def tool(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.mark.parametrize(
    "extra,param,words",
    [
        ({"tools": [{"type": "function"}]}, "tools[0].function", "required"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type", ""),
        ({"tools": [tool("")]}, "tools[0].function.name", ""),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "tools[0].function.parameters", ""),
        ({"tools": [tool("f")] * 2}, "tools", "unique"),
        ({"tools": [tool(f"f{i}") for i in range(129)]}, "tools", "at most 128"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"tools": [], "tool_choice": tool("f")}, "tool_choice", "tools"),
        ({"tools": [tool("f")], "tool_choice": tool("g")}, "tool_choice", "'g'"),
        ({"tools": [tool("f")], "tool_choice": "any"}, "tool_choice", ""),
        ({"functions": [{"name": "f"}]}, "functions", "tools"),
        ({"function_call": "auto"}, "function_call", "tools"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, None, ""),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
            "messages[0].tool_calls[0].id",
            "",
        ),
    ],
)  # fmt: skip
def test_bad_tool_requests_get_400s(tokenizer, extra, param, words):
    async def body():
        async with live_server(tokenizer, replying(tokenizer), tool_call_parser="hermes") as srv:
            r = await post(srv.url, "/v1/chat/completions", {"messages": USER, **extra})
            if param is None:  # accepted: an empty tool_calls list changes nothing
                assert r.status_code == 200, r.text
                return
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["type"], err["code"], err["param"]) == ("BadRequestError", 400, param)
            assert words in err["message"]
            assert srv.scheduler.requests == []

    run(body)


def test_tools_need_a_tool_call_parser(tokenizer):
    async def body():
        async with live_server(tokenizer, replying(tokenizer, CALLS_TEXT)) as srv:
            r = await post(srv.url, "/v1/chat/completions", {"messages": USER, "tools": TOOLS})
            assert r.status_code == 400
            err = r.json()["error"]
            assert err["param"] == "tools" and "--tool-call-parser" in err["message"]
            # tool_choice "none" asks for no parsing: served, the text as content
            r = await post(
                srv.url,
                "/v1/chat/completions",
                {"messages": USER, "tools": TOOLS, "tool_choice": "none"},
            )
            assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": CALLS_TEXT}
            # text completions know no tools
            r = await post(srv.url, "/v1/completions", {"prompt": "x", "tools": TOOLS})
            assert (r.status_code, r.json()["error"]["param"]) == (400, "tools")

    run(body)


def test_unknown_parser_name_fails_at_start():
    from gyrfalcon.frontend.server import create_app

    with pytest.raises(ValueError, match="llama3_json"):
        create_app(None, None, MODEL_NAME, tool_call_parser="qwen")  # type: ignore[arg-type]
