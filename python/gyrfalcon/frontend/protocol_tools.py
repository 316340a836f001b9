"""Function calling in chat requests: OpenAI's `tools`, `tool_choice` and the
tool calls of earlier assistant turns, as the chat template takes them.

Validation is OpenAI's (a 400 naming the field): a tool is
`{"type": "function", "function": {"name", "description"?, "parameters"?}}`,
`tool_choice` is "none" | "auto" | "required" | `{"type": "function",
"function": {"name"}}` naming one of `tools`. "required" and a named function
are forced by a grammar (tool_grammar.py); whether the server can parse the
calls of "auto" (`--tool-call-parser`) is the serving layer's check.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from gyrfalcon.frontend.protocol_fields import ParamError, RequestModel

MAX_TOOLS = 128  # OpenAI's limit on `tools`
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema of the arguments
    # xgrammar's strict mode (no properties beyond the schema's) when tool_choice
    # forces this function (frontend/tool_grammar.py); otherwise not enforced
    strict: bool | None = None


class ToolParam(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def to_template(self) -> dict[str, Any]:
        """OpenAI's tool dict, as transformers' `apply_chat_template(tools=...)`
        takes it (declared fields only: ignored extras stay out of the prompt).

        NOTE: absent parameters are OpenAI's "no parameters", written out: templates
        read `function.parameters` and fail on an undefined one.
        """
        f = self.function
        function: dict[str, Any] = {"name": f.name}
        if f.description is not None:
            function["description"] = f.description
        function["parameters"] = f.parameters if f.parameters is not None else NO_PARAMETERS
        return {"type": "function", "function": function}


class FunctionName(RequestModel):
    name: str


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallParam(RequestModel):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends a JSON string


class ToolCallParam(RequestModel):
    """A call of an earlier assistant turn (`messages[i].tool_calls[j]`)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam

    def to_template(self) -> dict[str, Any]:
        """The call with its arguments as a dict where they are a JSON object.

        NOTE: OpenAI sends the arguments as a JSON string; chat templates (Qwen's,
        Llama 3's, Hermes') write `arguments | tojson`, which would quote that string
        again: transformers' convention (and vLLM's) is a dict. Arguments that are
        not a JSON object pass as the string they are.
        """
        args: Any = self.function.arguments
        if isinstance(args, str):
            parsed = _json_object(args)
            args = args if parsed is None else parsed
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.function.name, "arguments": args},
        }


def _json_object(text: str) -> dict[str, Any] | None:
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def check_tool_choice(tools: list[ToolParam], choice: ToolChoice | None) -> None:
    """400 (ParamError) for too many tools, a name used twice, or a tool_choice
    that asks for a call among no tools or names a function not in `tools`."""
    if len(tools) > MAX_TOOLS:
        raise ParamError("tools", f"at most {MAX_TOOLS} tools are allowed; got {len(tools)}")
    names = [t.function.name for t in tools]
    twice = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if twice is not None:
        raise ParamError("tools", f"tool names must be unique; {twice!r} appears twice")
    if choice is None or choice in ("none", "auto"):
        return
    if not tools:
        shown = repr(choice) if isinstance(choice, str) else "naming a function"
        raise ParamError("tool_choice", f"tool_choice {shown} requires a non-empty `tools`")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise ParamError(
            "tool_choice",
            f"tool_choice names the function {choice.function.name!r}, which is not in "
            f"`tools` ({', '.join(names)})",
        )
