"""Structured output in a request: the fields that ask for it, and the
`StructuredOutput` (ipc/messages.py) each one becomes.

Which fields:

- OpenAI's `response_format`: `{"type": "text"}` (free text), `{"type":
  "json_object"}` or `{"type": "json_schema", "json_schema": {"name"?,
  "description"?, "schema", "strict"?}}`;
- SGLang's `regex`, `ebnf` (GBNF, start rule `root`) and `json_schema` (the
  schema's text, or the schema itself);
- vLLM's `structured_outputs` (exactly one of `json`, `regex`, `choice`,
  `grammar`, `json_object`) and its older `guided_json`, `guided_regex`,
  `guided_choice`, `guided_grammar`.

A request uses one of them at most (two are a 400 naming the second). The spec
is built with xgrammar here (`grammar.spec.build_grammar`), so a spec it refuses
is a 400 naming the field before anything reaches the engine. A `choice` list
becomes an EBNF grammar whose only sentences are its strings.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, model_validator

from gyrfalcon.frontend.protocol_fields import ParamError, RequestModel
from gyrfalcon.grammar.spec import GrammarError, build_grammar, json_schema_output
from gyrfalcon.ipc.messages import StructuredOutput

# NOTE: xgrammar's time to build a JSON-schema grammar grows much faster than the
# schema's nesting (seconds past a few hundred levels), and it runs on the event
# loop: bound the nesting. OpenAI allows 5 levels of objects.
MAX_SCHEMA_DEPTH = 64  # JSON nesting of a schema document (objects and arrays)

Schema = dict[str, Any] | str  # a JSON schema, or its text


class JsonSchemaFormat(RequestModel):
    """`response_format.json_schema`."""

    name: str | None = None  # OpenAI requires it; like vLLM, optional here
    description: str | None = None
    # NOTE: `schema` would shadow a BaseModel attribute: the alias keeps the wire name
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def output(self) -> StructuredOutput | None:
        """None for free text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput(kind="json_object")
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise ParamError(
                "response_format",
                "response_format of type 'json_schema' needs `json_schema.schema`",
            )
        schema = self.json_schema.schema_
        check_depth(schema, "response_format")
        return json_schema_output(schema, strict=self.json_schema.strict is True)


class StructuredOutputsParam(RequestModel):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: Schema | None = Field(None, alias="json")  # `json` would shadow BaseModel.json
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _one_key(self) -> StructuredOutputsParam:
        given = [k for k in _VLLM_KEYS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            names = ", ".join(k.rstrip("_") for k in _VLLM_KEYS)
            raise ParamError(
                "structured_outputs",
                f"structured_outputs takes exactly one of {names}; got {len(given)}",
            )
        return self

    def output(self) -> StructuredOutput:
        param = "structured_outputs"
        if self.json_ is not None:
            return schema_output(self.json_, param)
        if self.regex is not None:
            return StructuredOutput(kind="regex", spec=self.regex)
        if self.choice is not None:
            return choice_output(self.choice, param)
        if self.grammar is not None:
            return StructuredOutput(kind="ebnf", spec=self.grammar)
        return StructuredOutput(kind="json_object")


_VLLM_KEYS = ("json_", "regex", "choice", "grammar", "json_object")


class StructuredFields(RequestModel):
    """The structured-output fields both completion endpoints take."""

    response_format: ResponseFormat | None = None
    # SGLang's
    regex: str | None = None
    ebnf: str | None = None
    json_schema: Schema | None = None
    # vLLM's
    structured_outputs: StructuredOutputsParam | None = None
    guided_json: Schema | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured_sources(self) -> list[tuple[str, StructuredOutput]]:
        """Each field that asks for structured output, with what it asks for
        (ParamError for a malformed one)."""
        rf, so, choice = self.response_format, self.structured_outputs, self.guided_choice
        out = {
            "response_format": None if rf is None else rf.output(),
            "regex": _spec("regex", self.regex),
            "ebnf": _spec("ebnf", self.ebnf),
            "json_schema": _schema(self.json_schema, "json_schema"),
            "structured_outputs": None if so is None else so.output(),
            "guided_json": _schema(self.guided_json, "guided_json"),
            "guided_regex": _spec("regex", self.guided_regex),
            "guided_choice": None if choice is None else choice_output(choice, "guided_choice"),
            "guided_grammar": _spec("ebnf", self.guided_grammar),
        }
        return [(param, output) for param, output in out.items() if output is not None]

    @property
    def structured(self) -> StructuredOutput | None:
        """The grammar the output must follow (None: free text); valid once the
        request is (`check_structured`)."""
        sources = self.structured_sources()
        return sources[0][1] if sources else None


def check_structured(sources: list[tuple[str, StructuredOutput]]) -> None:
    """400 (ParamError) for two sources, or a spec xgrammar cannot build."""
    if len(sources) > 1:
        (first, _), (second, _) = sources[:2]
        raise ParamError(
            second,
            f"a request may ask for one structured output only; `{first}` and `{second}` both do",
        )
    for param, so in sources:
        try:
            build_grammar(so)
        except GrammarError as exc:
            raise ParamError(param, f"{param}: {exc}") from None


def _spec(kind: str, spec: str | None) -> StructuredOutput | None:
    return None if spec is None else StructuredOutput(kind=kind, spec=spec)


def _schema(schema: Schema | None, param: str) -> StructuredOutput | None:
    return None if schema is None else schema_output(schema, param)


def schema_output(schema: Schema, param: str, strict: bool = False) -> StructuredOutput:
    """A JSON schema given as an object or as its text (ParamError for text that
    is not JSON, or nesting past MAX_SCHEMA_DEPTH)."""
    if isinstance(schema, str):
        try:
            parsed = json.loads(schema)
        except ValueError as exc:
            raise ParamError(param, f"{param}: the schema is not valid JSON: {exc}") from None
        check_depth(parsed, param)
        return json_schema_output(schema, strict)
    check_depth(schema, param)
    return json_schema_output(schema, strict)


def check_depth(value: Any, param: str, limit: int = MAX_SCHEMA_DEPTH) -> None:
    """ParamError if `value` nests objects and arrays deeper than `limit`."""
    level = [value]
    for _ in range(limit):
        level = [
            item
            for v in level
            if isinstance(v, (dict, list))
            for item in (v.values() if isinstance(v, dict) else v)
        ]
        if not level:
            return
    if any(isinstance(v, (dict, list)) for v in level):
        raise ParamError(
            param, f"{param}: the schema nests more than {limit} levels of objects and arrays"
        )


def choice_output(choices: list[str], param: str) -> StructuredOutput:
    """The output is exactly one of `choices`."""
    if not choices:
        raise ParamError(param, f"{param}: the choice list must not be empty")
    if any("\0" in c for c in choices):
        # NOTE: xgrammar's EBNF literals end at a NUL
        raise ParamError(param, f"{param}: a choice must not contain a NUL character")
    return StructuredOutput(kind="ebnf", spec=choice_ebnf(choices))


def choice_ebnf(choices: list[str]) -> str:
    """`root ::= "a" | "b" | ...`: every string as an EBNF literal."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in dict.fromkeys(choices))


def _ebnf_literal(text: str) -> str:
    """`text` as an EBNF string literal: quote and backslash escaped, control and
    other non-printing characters as \\u / \\U escapes, the rest as it is."""
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ch.isprintable():
            out.append(ch)
        elif ord(ch) <= 0xFFFF:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(f"\\U{ord(ch):08x}")
    return '"' + "".join(out) + '"'
