"""tool_choice "required" and a named function, forced by a grammar
(frontend/tool_grammar.py): the schema each builds, what that grammar accepts,
how its output becomes tool calls (whole, streamed or not), the 400s, and the
calls over HTTP with no --tool-call-parser."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from gyrfalcon.frontend.protocol import ChatCompletionRequest, to_sampling_params
from gyrfalcon.frontend.protocol_tools import ToolParam
from gyrfalcon.frontend.serving_tools import ToolCalling, finish_reason
from gyrfalcon.frontend.tool_grammar import parse_forced_calls, required_calls_schema
from gyrfalcon.frontend.tool_parsers import TOOL_CALL_ID_PREFIX, ToolCall
from gyrfalcon.ipc.messages import StructuredOutput

from .frontend_fakes import MODEL_NAME, USER, live_server, post, replying, run
from .grammar_check import accepted
from .test_protocol import param_of
from .test_server_tools import TOOLS, WEATHER_TOOL, calls_of, client_for, streamed

NAMED = {"type": "function", "function": {"name": "get_weather"}}
WEATHER_PARAMS = WEATHER_TOOL["function"]["parameters"]
TWO_CALLS = (
    '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
    '{"name": "get_time", "parameters": {}}]'
)


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **kw})


def forced(**kw: Any) -> StructuredOutput | None:
    return to_sampling_params(chat(**kw), 16).structured


def tools_of(*raw: dict[str, Any]) -> list[ToolParam]:
    return [ToolParam.model_validate(t) for t in raw]


def func(name: str, parameters: dict[str, Any] | None = None, strict: bool | None = None):
    f: dict[str, Any] = {"name": name}
    if parameters is not None:
        f["parameters"] = parameters
    if strict is not None:
        f["strict"] = strict
    return {"type": "function", "function": f}


# ---------------------------------------------------------------- the schemas


def test_a_named_function_forces_its_parameters_schema():
    assert forced(tools=TOOLS, tool_choice=NAMED) == StructuredOutput(
        kind="json_schema", spec=json.dumps(WEATHER_PARAMS)
    )
    so = forced(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert so is not None and json.loads(so.spec) == {"type": "object", "properties": {}}
    texts = ['{"city": "Oslo"}', '{"town": "Oslo"}', "[]"]
    assert accepted(forced(tools=TOOLS, tool_choice=NAMED), texts) == [True, False, False]
    # strict: the function's own flag
    strict = [func("f", {"type": "object", "properties": {"a": {"type": "integer"}}}, strict=True)]
    so = forced(tools=strict, tool_choice={"type": "function", "function": {"name": "f"}})
    assert so is not None and so.strict
    assert accepted(so, ['{"a": 1}', '{"a": 1, "b": 2}']) == [True, False]


def test_no_forcing_without_a_forcing_tool_choice():
    assert forced() is None
    for choice in (None, "auto", "none"):
        assert forced(tools=TOOLS, tool_choice=choice) is None


def test_required_is_an_array_of_calls_of_the_tools():
    schema = required_calls_schema(tools_of(*TOOLS), parallel=True)
    assert (schema["type"], schema["minItems"], "maxItems" in schema) == ("array", 1, False)
    items = schema["items"]["anyOf"]
    names = [i["properties"]["name"] for i in items]
    assert names == [{"const": "get_weather"}, {"const": "get_time"}]
    for item in items:
        assert item["required"] == ["name", "parameters"]
        assert item["additionalProperties"] is False
    assert schema["$defs"]["tool_0"] == WEATHER_PARAMS
    assert schema["$defs"]["tool_1"] == {"type": "object", "properties": {}}  # no parameters
    assert required_calls_schema(tools_of(*TOOLS), parallel=False)["maxItems"] == 1
    one = required_calls_schema(tools_of(WEATHER_TOOL), parallel=True)
    assert one["items"]["properties"]["name"] == {"const": "get_weather"}  # no anyOf of one

    so = forced(tools=TOOLS, tool_choice="required")
    assert so is not None and so.kind == "json_schema" and not so.strict
    assert json.loads(so.spec) == schema
    texts = [
        '[{"name": "get_weather", "parameters": {"city": "Paris"}}]',
        TWO_CALLS,
        "[]",  # at least one call
        '[{"name": "get_news", "parameters": {}}]',  # not a tool
        '[{"name": "get_weather", "parameters": {"city": 5}}]',  # not its schema
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}]',  # "parameters" it is
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',  # an array it is
    ]
    assert accepted(so, texts) == [True, True, False, False, False, False, False]
    # parallel_tool_calls false: one call at most
    one_call = forced(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert accepted(one_call, texts[:2]) == [True, False]


def test_required_is_strict_when_every_tool_is():
    params = {"type": "object", "properties": {"a": {"type": "integer"}}}
    both = [func("f", params, strict=True), func("g", params, strict=True)]
    assert forced(tools=both, tool_choice="required").strict
    assert not forced(tools=[both[0], func("g", params)], tool_choice="required").strict


def test_refs_of_a_tool_still_resolve_inside_the_array():
    point = {
        "type": "object",
        "properties": {"x": {"type": "integer"}, "next": {"$ref": "#"}},
        "required": ["x"],
        "additionalProperties": False,
    }
    params = {
        "type": "object",
        "properties": {
            "p": {"$ref": "#/$defs/Point"},
            # data that looks like a ref, and a property named like a data keyword
            "tag": {"const": {"$ref": "#/x"}},
            "default": {"$ref": "#/definitions/Unit"},
        },
        "required": ["p"],
        "additionalProperties": False,
        "$defs": {
            "Point": {
                **point,
                "properties": {"x": {"type": "integer"}, "next": {"$ref": "#/$defs/Point"}},
            }
        },
        "definitions": {"Unit": {"enum": ["C", "F"]}},
    }
    tools = [func("get_time"), func("plot", params)]
    defs = required_calls_schema(tools_of(*tools), parallel=True)["$defs"]["tool_1"]
    assert defs["properties"]["p"] == {"$ref": "#/$defs/tool_1/$defs/Point"}
    assert defs["properties"]["tag"] == {"const": {"$ref": "#/x"}}
    assert defs["properties"]["default"] == {"$ref": "#/$defs/tool_1/definitions/Unit"}
    assert defs["$defs"]["Point"]["properties"]["next"] == {"$ref": "#/$defs/tool_1/$defs/Point"}
    so = forced(tools=tools, tool_choice="required")
    call = '[{"name": "plot", "parameters": {"p": {"x": 1, "next": {"x": 2}}, "default": "C"}}]'
    bad = '[{"name": "plot", "parameters": {"p": {"x": 1, "next": {"y": 2}}}}]'
    assert accepted(so, [call, bad]) == [True, False]
    # a root reference ("#") is rebased too
    tools = [func("get_time"), func("chain", point)]
    so = forced(tools=tools, tool_choice="required")
    chain = '[{"name": "chain", "parameters": {"x": 1, "next": {"x": 2, "next": {"x": 3}}}}]'
    assert accepted(so, [chain, '[{"name": "chain", "parameters": {"next": {}}}]']) == [True, False]


# ---------------------------------------------------------------- 400s


@pytest.mark.parametrize(
    "kw,param,words",
    [
        # a forcing tool_choice is a structured output of its own
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice", "`response_format` and `tool_choice`"),
        ({"tools": TOOLS, "tool_choice": NAMED, "guided_regex": "a"}, "tool_choice", "`guided_regex`"),
        # a parameters schema xgrammar refuses, when the choice may call that tool
        ({"tools": [func("f", {"type": "foo"})], "tool_choice": "required"}, "tools", "'f'"),
        ({"tools": [func("f", {"type": "foo"}), func("g")], "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools", "foo"),
        ({"tools": [func("f", {"type": "string", "pattern": "("})], "tool_choice": "required"}, "tools", "parenthesis"),
        ({"tools": [func("f", {"$ref": "#/$defs/nope"})], "tool_choice": "required"}, "tools", "nope"),
        # the checks of tool_choice come first
        ({"tools": [func("f", {"type": "foo"})], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "'g'"),
    ],
)  # fmt: skip
def test_bad_forced_requests_are_400s(kw, param, words):
    with pytest.raises(ValidationError) as info:
        chat(**kw)
    assert param_of(info.value) == param
    assert words in str(info.value)


def test_a_schema_only_the_forced_choice_would_use_is_not_checked():
    bad = func("f", {"type": "foo"})
    assert chat(tools=[bad], tool_choice="auto").structured is None
    named = {"type": "function", "function": {"name": "g"}}
    assert chat(tools=[bad, func("g")], tool_choice=named).structured is not None
    # and a free-text format is no structured output
    assert forced(tools=TOOLS, tool_choice=NAMED, response_format={"type": "text"}) is not None


# ---------------------------------------------------------------- reading the output


def forced_calling(named: str | None = None, parallel: bool = True) -> ToolCalling:
    return ToolCalling(None, named, ("get_weather", "get_time"), parallel)


def test_a_named_output_is_the_arguments_of_one_call():
    named = forced_calling("get_weather")
    assert named.parse('{"city": "Paris"}') == (
        None,
        [ToolCall("get_weather", '{"city": "Paris"}')],
    )
    # arguments as JSON text (json.dumps's separators), non-ASCII as it is
    _, calls = named.parse('{"city":"Zürich","n":[1,2]}')
    assert calls[0].arguments == '{"city": "Zürich", "n": [1, 2]}'
    # an output cut short, or not an object: no call, the text as content
    assert named.parse('{"city": "Par') == ('{"city": "Par', [])
    assert named.parse("[1]") == ("[1]", [])
    assert parse_forced_calls("", "f", ()) is None


def test_a_required_output_is_one_call_per_item():
    calls = [ToolCall("get_weather", '{"city": "Paris"}'), ToolCall("get_time", "{}")]
    assert forced_calling().parse(TWO_CALLS) == (None, calls)
    assert forced_calling(parallel=False).parse(TWO_CALLS) == (None, calls[:1])
    unknown = '[{"name": "get_news", "parameters": {}}]'
    for text in ("[]", unknown, '[{"name": "get_time"', "{}", '["x"]'):
        assert forced_calling().parse(text) == (text, [])


def deltas_of(calling: ToolCalling, text: str) -> list[dict[str, Any]]:
    stream = calling.stream()
    out = [d for ch in text for d in stream.feed(ch)]
    assert out == []  # a forced call is read once the output is whole
    out = stream.finish()
    assert stream.called == any("tool_calls" in d for d in out)
    return out


def test_a_forced_stream_sends_each_call_whole_at_the_end():
    deltas = deltas_of(forced_calling(), TWO_CALLS)
    heads = [c for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    assert [(c["index"], c["type"], c["function"]["name"]) for c in heads] == [
        (0, "function", "get_weather"),
        (1, "function", "get_time"),
    ]
    assert all(c["id"].startswith(TOOL_CALL_ID_PREFIX) for c in heads)
    assert len({c["id"] for c in heads}) == 2
    parts = [c for d in deltas for c in d.get("tool_calls", []) if "id" not in c]
    assert [c["function"]["arguments"] for c in parts] == ['{"city": "Paris"}', "{}"]
    first = deltas_of(forced_calling(parallel=False), TWO_CALLS)
    assert [c["function"].get("name") for d in first for c in d["tool_calls"]] == [
        "get_weather",
        None,
    ]
    assert deltas_of(forced_calling("get_time"), "cut sho") == [{"content": "cut sho"}]
    assert finish_reason("stop", called=True) == "tool_calls"


# ---------------------------------------------------------------- over HTTP


def test_forced_calls_over_http_without_a_parser(tokenizer):
    answers = {"named": '{"city": "Oslo"}', "required": TWO_CALLS, "cut": '[{"name": "get_w'}

    def script(req):
        text = tokenizer.decode(req.prompt_ids)
        key = next(k for k in answers if f"ask-{k}" in text)
        return replying(tokenizer, answers[key], finish="length" if key == "cut" else "stop")(req)

    async def body():
        async with live_server(tokenizer, script) as srv:  # NOTE: no --tool-call-parser
            client = client_for(srv.url)

            def ask(key: str) -> list[dict[str, str]]:
                return [{"role": "user", "content": f"ask-{key}"}]

            oslo = [("get_weather", {"city": "Oslo"})]
            resp = await client.chat.completions.create(
                model=MODEL_NAME, messages=ask("named"), tools=TOOLS, tool_choice=NAMED
            )
            choice = resp.choices[0]
            assert calls_of(choice.message) == oslo and choice.message.content is None
            assert choice.finish_reason == "tool_calls"
            assert choice.message.tool_calls[0].function.arguments == '{"city": "Oslo"}'
            got = await streamed(client, messages=ask("named"), tools=TOOLS, tool_choice=NAMED)
            assert got == {0: {"content": "", "calls": oslo, "finish": "tool_calls"}}

            two = [("get_weather", {"city": "Paris"}), ("get_time", {})]
            resp = await client.chat.completions.create(
                model=MODEL_NAME, messages=ask("required"), tools=TOOLS, tool_choice="required", n=2
            )
            for choice in resp.choices:
                assert calls_of(choice.message) == two and choice.finish_reason == "tool_calls"
                assert len({c.id for c in choice.message.tool_calls}) == 2
            required = {"messages": ask("required"), "tools": TOOLS, "tool_choice": "required"}
            got = await streamed(client, **required)
            assert got == {0: {"content": "", "calls": two, "finish": "tool_calls"}}
            got = await streamed(client, **required, parallel_tool_calls=False)
            assert got[0]["calls"] == two[:1]

            # cut short by max_tokens: no call, the text, "length"
            resp = await client.chat.completions.create(
                model=MODEL_NAME, messages=ask("cut"), tools=TOOLS, tool_choice="required"
            )
            choice = resp.choices[0]
            assert (choice.message.content, choice.message.tool_calls) == (answers["cut"], None)
            assert choice.finish_reason == "length"

            # the engine got each request's grammar
            sent = [q.sampling.structured for q in srv.scheduler.requests]
            named_so = StructuredOutput(kind="json_schema", spec=json.dumps(WEATHER_PARAMS))
            assert sent[:2] == [named_so, named_so]
            required = json.loads(sent[2].spec)
            assert required["minItems"] == 1 and "maxItems" not in required
            assert json.loads(sent[5].spec)["maxItems"] == 1  # parallel_tool_calls false
            # "auto" still needs --tool-call-parser
            r = await post(srv.url, "/v1/chat/completions", {"messages": USER, "tools": TOOLS})
            assert (r.status_code, r.json()["error"]["param"]) == (400, "tools")
            await client.close()

    run(body)
