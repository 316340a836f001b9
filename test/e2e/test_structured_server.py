"""Structured output, served: SmolLM2 (greedy and sampled) through the HTTP API
follows `response_format`, a regex, a choice list, and a forced tool_choice
("required" or a named function, no --tool-call-parser), streamed and not."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from structured_util import SCHEMAS

PERSON = SCHEMAS["person"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 16}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"tz": {"enum": ["UTC", "CET"]}},
                "required": ["tz"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_response_format_json_schema(client, model_name, temperature):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    resp = client.chat.completions.create(
        model=model_name, messages=messages, response_format=fmt, temperature=temperature,
        max_tokens=96, n=2, seed=3,
    )  # fmt: skip
    for choice in resp.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    text, finish = "", None
    for chunk in client.completions.create(
        model=model_name, prompt="A person, as JSON:", stream=True, max_tokens=96,
        temperature=temperature, extra_body={"guided_json": PERSON},
    ):  # fmt: skip
        text += chunk.choices[0].text if chunk.choices else ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), PERSON)


def test_regex_and_choice_on_completions(client, model_name):
    resp = client.completions.create(
        model=model_name, prompt="The date today is", max_tokens=24, temperature=0,
        extra_body={"regex": r" \d{4}-\d{2}-\d{2}"},
    )  # fmt: skip
    assert re.fullmatch(r" \d{4}-\d{2}-\d{2}", resp.choices[0].text), resp.choices[0].text
    choices = ['"yes"', "no (really)", "a|b*"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        resp = client.completions.create(
            model=model_name, prompt="Answer:", max_tokens=16, temperature=1.0, n=4,
            extra_body=extra,
        )  # fmt: skip
        assert all(c.text in choices for c in resp.choices), resp.choices


def check_calls(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMS[name])


def test_forced_tool_calls(client, model_name):
    named = {"type": "function", "function": {"name": "get_time"}}
    for choice_kw in (named, "required"):
        kw = dict(model=model_name, messages=ASK, tools=TOOLS, tool_choice=choice_kw,
                  max_tokens=64, temperature=0)  # fmt: skip
        choice = client.chat.completions.create(**kw).choices[0]
        assert choice.finish_reason == "tool_calls", choice
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert calls and choice.message.content is None
        check_calls(calls)
        if choice_kw == named:
            assert [n for n, _ in calls] == ["get_time"]
        streamed: dict[int, list[str]] = {}
        finish = None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for c in chunk.choices:
                for part in c.delta.tool_calls or []:
                    got = streamed.setdefault(part.index, ["", ""])
                    got[0] += part.function.name or ""
                    got[1] += part.function.arguments or ""
                finish = c.finish_reason or finish
        assert [tuple(v) for _, v in sorted(streamed.items())] == calls  # greedy: the same
        assert finish == "tool_calls"
