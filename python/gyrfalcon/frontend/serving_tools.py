"""Tool calls in chat completions: which parser reads a request's output, and
what `tool_choice` and `parallel_tool_calls` make of the calls it finds.

- "auto" and "required": the parser's calls. NOTE: without constrained
  decoding, "required" cannot make the model call: its calls may be none.
- a named function: the first call of that function; failing one, an output
  that is a JSON object is taken as that call (or as its arguments), as vLLM
  did before guided decoding. A stream of a named choice is parsed at its end.
- `parallel_tool_calls: false`: the first call only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from gyrfalcon.frontend.protocol import ChatCompletionRequest
from gyrfalcon.frontend.serving_common import RequestError
from gyrfalcon.frontend.tool_parsers import (
    TOOL_PARSERS,
    Delta,
    ToolCall,
    ToolCallStream,
    ToolParser,
    call_deltas,
    call_from_object,
    get_tool_parser,
)

FINISH_TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class ToolCalling:
    """How one request's choices are searched for tool calls."""

    parser: ToolParser
    named: str | None = None  # a named tool_choice's function
    parallel: bool = True

    @classmethod
    def of(cls, parser_name: str | None, req: ChatCompletionRequest) -> ToolCalling | None:
        """None when the output is plain content (no tools, or tool_choice "none");
        a 400 when tools are to be called but the server parses no calls."""
        if not req.parses_tool_calls:
            return None
        if parser_name is None:
            raise RequestError(
                "this server parses no tool calls: start it with --tool-call-parser "
                f"({' or '.join(TOOL_PARSERS)}), or send tool_choice 'none'",
                param="tools",
            )
        return cls(
            get_tool_parser(parser_name), req.named_tool, req.parallel_tool_calls is not False
        )

    def skip_special_tokens(self, req: ChatCompletionRequest) -> bool:
        """The request's flag, unless it left it unset and the parser's markers
        may be special tokens."""
        if self.parser.keeps_special_tokens and "skip_special_tokens" not in req.model_fields_set:
            return False
        return req.skip_special_tokens

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """One choice's whole output -> (content, calls)."""
        content, calls = self.parser.parse(text)
        if self.named is not None:
            content, calls = _named_call(text, content, calls, self.named)
        return content, calls if self.parallel else calls[:1]

    def stream(self) -> ChoiceToolStream:
        return ChoiceToolStream(self)


def _named_call(
    text: str, content: str | None, calls: list[ToolCall], name: str
) -> tuple[str | None, list[ToolCall]]:
    mine = [c for c in calls if c.name == name]
    if mine:
        return content, mine[:1]
    try:
        obj = json.loads(text)
    except ValueError:
        return text, []
    if not isinstance(obj, dict):
        return text, []
    call = call_from_object(obj)
    if call is None or call.name != name:  # the object is the arguments
        call = ToolCall(name, json.dumps(obj, ensure_ascii=False))
    return None, [call]


@dataclass
class ChoiceToolStream:
    """One streamed choice: text deltas in, OpenAI deltas out, `called` once a
    call was sent."""

    calling: ToolCalling
    called: bool = False
    _stream: ToolCallStream | None = field(init=False)
    _text: list[str] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        # NOTE: a named choice may fall back to the whole output: it waits for all of it
        self._stream = None if self.calling.named else self.calling.parser.stream()

    def feed(self, text: str) -> list[Delta]:
        if self._stream is None:
            self._text.append(text)
            return []
        return self._kept(self._stream.feed(text))

    def finish(self) -> list[Delta]:
        if self._stream is not None:
            return self._kept(self._stream.finish())
        content, calls = self.calling.parse("".join(self._text))
        deltas: list[Delta] = [{"content": content}] if content else []
        for i, call in enumerate(calls):
            deltas += call_deltas(i, call)
        return self._kept(deltas)

    def _kept(self, deltas: list[Delta]) -> list[Delta]:
        out = []
        for delta in deltas:
            calls = delta.get("tool_calls")
            if calls and not self.calling.parallel and calls[0]["index"] > 0:
                continue  # NOTE: parallel_tool_calls false: the first call only
            self.called = self.called or bool(calls)
            out.append(delta)
        return out


def finish_reason(reason: str | None, called: bool) -> str | None:
    """ "tool_calls" for a choice that called and ended by itself (OpenAI's and
    vLLM's); a cut-short one ("length") says so."""
    return FINISH_TOOL_CALLS if called and reason == "stop" else reason
