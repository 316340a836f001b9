"""A tool call forced by a grammar: `tool_choice` "required" or a named function.

The output is constrained (structured output) to JSON that holds the calls, so
no tool-call parser reads it:

- a named function: a JSON object matching the function's `parameters` schema;
  the whole output is the arguments of one call of that function;
- "required": a JSON array of one or more `{"name": <a tool's name>,
  "parameters": <that tool's arguments>}` (at most one with
  `parallel_tool_calls: false`), one call per item.

An output that is not that JSON (cut short by `max_tokens` or a stop string)
holds no call: it is the choice's content.
"""

from __future__ import annotations

import json
from typing import Any

from gyrfalcon.frontend.protocol_fields import ParamError
from gyrfalcon.frontend.protocol_structured import schema_output
from gyrfalcon.frontend.protocol_tools import NO_PARAMETERS, NamedToolChoice, ToolChoice, ToolParam
from gyrfalcon.frontend.tool_parsers import ToolCall, call_from_object
from gyrfalcon.grammar.spec import GrammarError, build_grammar, json_schema_output
from gyrfalcon.ipc.messages import StructuredOutput

# schema keywords whose values are data, not schemas: no `$ref` in them is rewritten
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# schema keywords whose values map names (not keywords) to schemas
_SCHEMA_MAPS = frozenset(
    {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
)


def forces_call(choice: ToolChoice | None) -> bool:
    """Whether `tool_choice` asks for a call the grammar must force."""
    return choice == "required" or isinstance(choice, NamedToolChoice)


def forced_tool_output(
    tools: list[ToolParam], choice: ToolChoice | None, parallel: bool
) -> StructuredOutput | None:
    """The grammar that forces `choice`'s call(s), or None when it forces none
    (`tools` and `choice` are valid: protocol_tools.check_tool_choice)."""
    if isinstance(choice, NamedToolChoice):
        tool = _named(tools, choice)
        return json_schema_output(_parameters(tool), strict=tool.function.strict is True)
    if choice != "required":
        return None
    # NOTE: strict mode is the whole grammar's: only when every tool asks for it
    strict = all(t.function.strict is True for t in tools)
    return json_schema_output(required_calls_schema(tools, parallel), strict=strict)


def check_forced_tools(tools: list[ToolParam], choice: ToolChoice | None) -> None:
    """400 (ParamError naming `tools`) for a tool `choice` may call whose
    `parameters` schema xgrammar refuses."""
    if not forces_call(choice):
        return
    for tool in [_named(tools, choice)] if isinstance(choice, NamedToolChoice) else tools:
        strict = tool.function.strict is True
        try:
            build_grammar(schema_output(_parameters(tool), "tools", strict=strict))
        except GrammarError as exc:
            name = tool.function.name
            raise ParamError("tools", f"tools: the parameters of {name!r}: {exc}") from None


def required_calls_schema(tools: list[ToolParam], parallel: bool) -> dict[str, Any]:
    """The JSON schema of "required"'s output: an array of calls of `tools`.

    Each tool's `parameters` sits in `$defs` under `tool_<i>`, its local `$ref`s
    rewritten to point there, so that its own `$defs` and `#` still resolve once it
    is nested in the array.
    """
    defs: dict[str, Any] = {}
    calls = []
    for i, tool in enumerate(tools):
        key = f"tool_{i}"
        defs[key] = _rebase_refs(_parameters(tool), f"#/$defs/{key}")
        calls.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": tool.function.name},
                    "parameters": {"$ref": f"#/$defs/{key}"},
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    schema["$defs"] = defs
    return schema


def parse_forced_calls(
    text: str, named: str | None, names: tuple[str, ...]
) -> list[ToolCall] | None:
    """The calls of a forced output: a named function's arguments object (`named`),
    or "required"'s array of calls of `names`; None if `text` is not that JSON.
    Each call's arguments are a JSON object's text, as OpenAI sends them."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if named is not None:
        if not isinstance(value, dict):
            return None
        return [ToolCall(named, json.dumps(value, ensure_ascii=False))]
    if not isinstance(value, list) or not value:
        return None
    calls = [call_from_object(item) for item in value]
    known = [c for c in calls if c is not None and c.name in names]
    return known if len(known) == len(calls) else None


def _parameters(tool: ToolParam) -> dict[str, Any]:
    params = tool.function.parameters
    return params if params is not None else NO_PARAMETERS


def _named(tools: list[ToolParam], choice: NamedToolChoice) -> ToolParam:
    return next(t for t in tools if t.function.name == choice.function.name)


def _rebase_refs(schema: Any, base: str) -> Any:
    """`schema` with every local `$ref` ("#" or "#/...") moved under `base`."""
    if isinstance(schema, list):
        return [_rebase_refs(item, base) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = base + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _rebase_refs(sub, base) for name, sub in value.items()}
        else:
            out[key] = _rebase_refs(value, base)
    return out
