"""The tool-call parsers (frontend/tool_parsers.py) and what tool_choice and
parallel_tool_calls make of their calls (frontend/serving_tools.py): pure text in,
calls and content out; a stream cut anywhere gives what the whole text gives."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from gyrfalcon.frontend.serving_tools import ToolCalling, finish_reason
from gyrfalcon.frontend.tool_parsers import (
    TOOL_CALL_ID_PREFIX,
    TOOL_PARSERS,
    ToolCall,
    get_tool_parser,
)

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
TIME = '{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}'
WEATHER_CALL = ToolCall("get_weather", '{"city": "Paris", "unit": "C"}')
TIME_CALL = ToolCall("get_time", '{"tz": "Europe/Paris"}')


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


# (text, content, calls) of the full-text parse
HERMES_CASES = [
    (block(WEATHER), None, [WEATHER_CALL]),
    (block(WEATHER) + "\n" + block(TIME), None, [WEATHER_CALL, TIME_CALL]),
    ("Let me look.\n" + block(WEATHER), "Let me look.", [WEATHER_CALL]),
    ("Checking.\n" + block(WEATHER) + "\nThen more.", "Checking.\nThen more.", [WEATHER_CALL]),
    ("No tools needed: 42.", "No tools needed: 42.", []),
    ("a < b and <tool is not a call", "a < b and <tool is not a call", []),
    # malformed JSON stays content, as the model wrote it
    (
        "Try " + block('{"name": "f", "arguments": {'),
        "Try " + block('{"name": "f", "arguments": {'),
        [],
    ),
    (block('{"arguments": {}}'), block('{"arguments": {}}'), []),  # no name
    # one good call, one bad: the bad one is content
    (block(WEATHER) + " " + block("nope"), block("nope"), [WEATHER_CALL]),
    # the model stopped before closing its last call
    ("<tool_call>\n" + WEATHER + "\n", None, [WEATHER_CALL]),
    # arguments as a JSON string (some models write that), and unicode kept as is
    (
        block('{"name": "say", "arguments": "{\\"text\\": \\"h\\u00e9\\"}"}'),
        None,
        [ToolCall("say", '{"text": "hé"}')],
    ),
    ("   ", "   ", []),
]

LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}', None, [WEATHER_CALL]),
    ("<|python_tag|>" + WEATHER, None, [WEATHER_CALL]),
    ("\n " + WEATHER + "; " + TIME, None, [WEATHER_CALL, TIME_CALL]),
    (WEATHER + ";", None, [WEATHER_CALL]),
    ("The weather is fine.", "The weather is fine.", []),
    ("<|python_", "<|python_", []),
    # anything that is not all calls is content, verbatim
    (WEATHER + " and some words", WEATHER + " and some words", []),
    ('{"name": "f", "parameters": {', '{"name": "f", "parameters": {', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),
]

ALL_CASES = [("hermes", *c) for c in HERMES_CASES] + [("llama3_json", *c) for c in LLAMA_CASES]


@pytest.mark.parametrize("parser,text,content,calls", ALL_CASES)
def test_full_text_parse(parser: str, text: str, content: str | None, calls: list[ToolCall]):
    assert get_tool_parser(parser).parse(text) == (content, calls)


def replay(parser: str, chunks: list[str]) -> tuple[str, list[ToolCall], list[dict[str, Any]]]:
    """Stream the chunks; the content, the calls rebuilt from the deltas, the deltas."""
    stream = get_tool_parser(parser).stream()
    deltas = [d for c in chunks for d in stream.feed(c)] + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    names: dict[int, str] = {}
    args: dict[int, str] = {}
    for d in deltas:
        for call in d.get("tool_calls", []):
            i = call["index"]
            if "id" in call:  # a call's first delta: its id, type and name, once
                assert i not in names and i == len(names)
                assert call["id"].startswith(TOOL_CALL_ID_PREFIX) and call["type"] == "function"
                names[i] = call["function"]["name"]
            else:
                assert i in names, "arguments before the call's name"
                args[i] = args.get(i, "") + call["function"]["arguments"]
    return content, [ToolCall(names[i], args.get(i, "")) for i in sorted(names)], deltas


def cuts(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, pos = [], 0
    while pos < len(text):
        step = rng.randint(1, 7)
        out.append(text[pos : pos + step])
        pos += step
    return out


@pytest.mark.parametrize("parser,text,content,calls", ALL_CASES)
def test_stream_in_any_chunks_equals_full_parse(
    parser: str, text: str, content: str | None, calls: list[ToolCall]
):
    splits = [[text], list(text)] + [cuts(text, seed) for seed in range(5)]
    # every split point inside the markers, with the rest in one piece
    for marker in ("<tool_call>", "</tool_call>", "<|python_tag|>"):
        at = text.find(marker)
        if at >= 0:
            splits += [[text[: at + k], text[at + k :]] for k in range(1, len(marker))]
    for chunks in splits:
        got_content, got_calls, _ = replay(parser, chunks)
        assert (got_content, got_calls) == (content or "", calls), chunks


def test_stream_holds_back_what_may_start_a_call():
    stream = get_tool_parser("hermes").stream()
    assert stream.feed("Sure. ") == [{"content": "Sure."}]
    assert stream.feed("<tool_") == []  # maybe a call: not shown
    assert stream.feed("x>") == [{"content": " <tool_x>"}]  # not one after all
    assert stream.feed(" <tool_call>" + WEATHER) == []  # a call, not complete yet
    head, args = stream.feed("</tool_call>")
    assert head["tool_calls"][0]["function"] == {"name": "get_weather"}
    assert json.loads(args["tool_calls"][0]["function"]["arguments"]) == {
        "city": "Paris",
        "unit": "C",
    }
    assert stream.finish() == []

    llama = get_tool_parser("llama3_json").stream()
    assert llama.feed(" <|py") == []
    assert llama.feed("thon_tag|>" + WEATHER) == []  # held to the end: all calls or none
    assert [d["tool_calls"][0]["index"] for d in llama.finish()] == [0, 0]
    prose = get_tool_parser("llama3_json").stream()
    assert prose.feed("Hi") == [{"content": "Hi"}]  # not a call: streamed at once
    assert prose.feed(" {") == [{"content": " {"}]


def test_call_ids_are_unique():
    _, _, deltas = replay("hermes", [block(WEATHER) * 3])
    ids = [c["id"] for d in deltas for c in d.get("tool_calls", []) if "id" in c]
    assert len(ids) == 3 == len(set(ids))


def test_parser_names_match_the_server_flag():
    from dataclasses import fields

    from gyrfalcon.config.server_args import ServerArgs

    flag = next(f for f in fields(ServerArgs) if f.name == "tool_call_parser")
    assert flag.metadata["choices"] == list(TOOL_PARSERS)
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("mistral")


# ---------------------------------------------------------------- tool_choice, parallel


def calling(parallel: bool = True) -> ToolCalling:
    return ToolCalling(get_tool_parser("hermes"), parallel=parallel)


def streamed(tools: ToolCalling, text: str) -> tuple[str, list[tuple[int, str]]]:
    stream = tools.stream()
    deltas = [d for ch in text for d in stream.feed(ch)] + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls = [
        (c["index"], c["function"]["name"])
        for d in deltas
        for c in d.get("tool_calls", [])
        if "id" in c
    ]
    assert stream.called == bool(calls)
    return content, calls


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = "x " + block(WEATHER) + block(TIME) + " y"
    assert calling().parse(text) == ("x y", [WEATHER_CALL, TIME_CALL])
    assert calling(parallel=False).parse(text) == ("x y", [WEATHER_CALL])
    assert streamed(calling(parallel=False), text) == ("x y", [(0, "get_weather")])
    assert streamed(calling(), text) == ("x y", [(0, "get_weather"), (1, "get_time")])


def test_finish_reason():
    assert finish_reason("stop", called=True) == "tool_calls"
    assert finish_reason("stop", called=False) == "stop"
    assert finish_reason("length", called=True) == "length"
