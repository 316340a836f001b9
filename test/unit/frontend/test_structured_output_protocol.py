"""Structured-output requests (frontend/protocol_structured.py): every form of
OpenAI's, SGLang's and vLLM's fields maps to the StructuredOutput the engine gets,
on both endpoints; a bad spec, or two of them, is a 400 naming the field, and the
server keeps serving."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from gyrfalcon.frontend.protocol import ChatCompletionRequest, CompletionRequest, to_sampling_params
from gyrfalcon.frontend.protocol_structured import MAX_SCHEMA_DEPTH, choice_ebnf
from gyrfalcon.ipc.messages import StructuredOutput

from .frontend_fakes import USER, live_server, post, replying, run
from .grammar_check import accepted
from .test_protocol import param_of

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_TEXT = json.dumps(SCHEMA)
ENDPOINTS = {
    "chat": lambda kw: ChatCompletionRequest.model_validate({"messages": USER, **kw}),
    "completion": lambda kw: CompletionRequest.model_validate({"prompt": "hi", **kw}),
}


@pytest.fixture(params=sorted(ENDPOINTS))
def make(request):
    return ENDPOINTS[request.param]


def structured_of(make, **kw: Any) -> StructuredOutput | None:
    return to_sampling_params(make(kw), 16).structured


def json_schema(spec: str = SCHEMA_TEXT, strict: bool = False) -> StructuredOutput:
    return StructuredOutput(kind="json_schema", spec=spec, strict=strict)


RF_SCHEMA = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
CHOICE = ["yes", "no"]
CHOICE_EBNF = StructuredOutput(kind="ebnf", spec='root ::= "yes" | "no"')


@pytest.mark.parametrize(
    "field,value,expected",
    [
        ("response_format", {"type": "text"}, None),
        ("response_format", {"type": "json_object"}, StructuredOutput(kind="json_object")),
        ("response_format", RF_SCHEMA, json_schema()),
        # name is optional (as in vLLM); strict reaches xgrammar's strict mode
        ("response_format", {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": True}}, json_schema(strict=True)),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "t", "description": "d", "schema": SCHEMA, "strict": None}}, json_schema()),
        # SGLang's
        ("regex", "[a-z]+", StructuredOutput(kind="regex", spec="[a-z]+")),
        ("ebnf", 'root ::= "a" | "b"', StructuredOutput(kind="ebnf", spec='root ::= "a" | "b"')),
        ("json_schema", SCHEMA_TEXT, json_schema()),
        ("json_schema", SCHEMA, json_schema()),
        # vLLM's
        ("structured_outputs", {"json": SCHEMA}, json_schema()),
        ("structured_outputs", {"json": SCHEMA_TEXT}, json_schema()),
        ("structured_outputs", {"regex": "a+"}, StructuredOutput(kind="regex", spec="a+")),
        ("structured_outputs", {"choice": CHOICE}, CHOICE_EBNF),
        ("structured_outputs", {"grammar": 'root ::= "x"'}, StructuredOutput(kind="ebnf", spec='root ::= "x"')),
        ("structured_outputs", {"json_object": True}, StructuredOutput(kind="json_object")),
        ("structured_outputs", {"regex": "a+", "json": None, "json_object": False}, StructuredOutput(kind="regex", spec="a+")),
        ("guided_json", SCHEMA, json_schema()),
        ("guided_json", SCHEMA_TEXT, json_schema()),
        ("guided_regex", "a+", StructuredOutput(kind="regex", spec="a+")),
        ("guided_choice", CHOICE, CHOICE_EBNF),
        ("guided_grammar", 'root ::= "x"', StructuredOutput(kind="ebnf", spec='root ::= "x"')),
        ("regex", None, None),
    ],
)  # fmt: skip
def test_every_form_maps_to_its_structured_output(make, field, value, expected):
    assert structured_of(make, **{field: value}) == expected


def test_free_text_and_a_format_of_text_with_another_field(make):
    assert structured_of(make) is None
    got = structured_of(make, response_format={"type": "text"}, regex="a+")
    assert got == StructuredOutput(kind="regex", spec="a+")


@pytest.mark.parametrize(
    "kw,param,words",
    [
        # invalid schema JSON, an unsupported type, missing schema
        ({"json_schema": '{"type": "object"'}, "json_schema", "not valid JSON"),
        ({"guided_json": "nope"}, "guided_json", "not valid JSON"),
        ({"structured_outputs": {"json": "{"}}, "structured_outputs", "not valid JSON"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}}, "response_format", "foo"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "json_schema.schema"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
        ({"guided_json": "[1, 2]"}, "guided_json", "object or bool"),
        ({"json_schema": '"a string"'}, "json_schema", "object or bool"),
        ({"json_schema": {"type": "integer", "minimum": 5, "maximum": 1}}, "json_schema", "minimum"),
        ({"guided_json": {"$ref": "#/$defs/missing"}}, "guided_json", "missing"),
        # an unclosed regex group, in each regex field and in a schema's pattern
        ({"regex": "(ab"}, "regex", "parenthesis"),
        ({"guided_regex": "[a-"}, "guided_regex", ""),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "parenthesis"),
        ({"guided_json": {"type": "string", "pattern": "("}}, "guided_json", "parenthesis"),
        # bad EBNF: no root, an undefined rule, a syntax error
        ({"ebnf": 'start ::= "a"'}, "ebnf", "root"),
        ({"guided_grammar": 'root ::= "a" | b'}, "guided_grammar", '"b"'),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "EBNF"),
        # choices: empty, or with a NUL (xgrammar's literals end there)
        ({"guided_choice": []}, "guided_choice", "empty"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs", "empty"),
        ({"guided_choice": ["a\0b"]}, "guided_choice", "NUL"),
        # vLLM's structured_outputs: exactly one key
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "got 2"),
        # two sources: the second is named
        ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex", "`response_format` and `regex`"),
        ({"guided_json": SCHEMA, "guided_choice": CHOICE}, "guided_choice", "one structured output"),
        ({"ebnf": 'root ::= "a"', "structured_outputs": {"regex": "a"}}, "structured_outputs", ""),
    ],
)  # fmt: skip
def test_bad_specs_are_400s_naming_the_field(make, kw, param, words):
    with pytest.raises(ValidationError) as info:
        make(kw)
    assert param_of(info.value) == param
    assert words in str(info.value)


def test_schema_nesting_is_bounded(make):
    deep: dict[str, Any] = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}  # two JSON levels each
    with pytest.raises(ValidationError) as info:
        make({"guided_json": deep})
    assert param_of(info.value) == "guided_json" and "nests" in str(info.value)
    as_format = {"type": "json_schema", "json_schema": {"schema": deep}}
    for kw in ({"json_schema": json.dumps(deep)}, {"response_format": as_format}):
        with pytest.raises(ValidationError):
            make(kw)
    shallow: dict[str, Any] = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH // 2 - 1):
        shallow = {"type": "array", "items": shallow}
    assert structured_of(make, guided_json=shallow) is not None


@pytest.mark.parametrize(
    "choices",
    [
        ["yes", "no"],
        ['say "hi"', "back\\slash", "a|b", "(x)*", "[", "^$.?+{2}", "it's"],
        ["é", "😀 emoji", "tab\there", "new\nline", "\x7f", "\u00a0nbsp"],
        ['root ::= "a"', "", "x"],
    ],
)
def test_a_choice_list_accepts_exactly_its_strings(choices):
    so = StructuredOutput(kind="ebnf", spec=choice_ebnf(choices))
    assert accepted(so, choices) == [True] * len(choices)
    near = [c + "x" for c in choices] + [c[:-1] for c in choices if len(c) > 1] + ["zz"]
    near = [t for t in near if t not in choices]
    assert accepted(so, near) == [False] * len(near)


def test_json_schema_grammar_follows_the_schema():
    so = structured_of(ENDPOINTS["chat"], response_format=RF_SCHEMA)
    assert so is not None
    assert accepted(so, ['{"a": 1}', '{"a": "x"}', '{"b": 1}', "[]"]) == [True, False, False, False]


def test_the_engine_gets_the_grammar_on_both_endpoints_and_bad_specs_are_400s(tokenizer):
    async def body():
        async with live_server(tokenizer, replying(tokenizer, '{"a": 1}')) as srv:
            ok = [
                ("/v1/chat/completions", {"messages": USER, "response_format": RF_SCHEMA}),
                ("/v1/completions", {"prompt": "hi", "response_format": RF_SCHEMA}),
                ("/v1/completions", {"prompt": "hi", "guided_choice": CHOICE, "n": 2}),
            ]
            for path, req in ok:
                r = await post(srv.url, path, req)
                assert r.status_code == 200, r.text
            got = [q.sampling.structured for q in srv.scheduler.requests]
            assert got == [json_schema(), json_schema(), CHOICE_EBNF, CHOICE_EBNF]
            bad = [
                ("/v1/chat/completions", {"messages": USER, "regex": "(a"}, "regex"),
                ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "foo"}}}}, "response_format"),
                ("/v1/completions", {"prompt": "hi", "response_format": {"type": "xml"}}, "response_format.type"),
                ("/v1/chat/completions", {"messages": USER, "ebnf": "root ::= ", "stream": True}, "ebnf"),
                ("/v1/completions", {"prompt": "hi", "guided_choice": []}, "guided_choice"),
            ]  # fmt: skip
            for path, req, param in bad:
                r = await post(srv.url, path, req)
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert (err["type"], err["code"], err["param"]) == ("BadRequestError", 400, param)
            assert len(srv.scheduler.requests) == 4  # the bad ones never reached the engine
            # ... and the server keeps serving
            r = await post(srv.url, "/v1/completions", {"prompt": "hi", "regex": "a+"})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == '{"a": 1}'

    run(body)
