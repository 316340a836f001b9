"""Tool calls in chat completions: how a request's output is read for calls,
and what `tool_choice` and `parallel_tool_calls` make of the calls found.

- "auto": the calls the server's parser (`--tool-call-parser`) finds, if any.
- "required" and a named function: the call is forced by a grammar
  (frontend/tool_grammar.py), and the output is the JSON that grammar makes: no
  parser reads it, and none need be configured. A forced choice's stream is read
  at its end, its calls sent whole.
- `parallel_tool_calls: false`: the first call only (the grammar of "required"
  allows one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gyrfalcon.frontend.protocol import ChatCompletionRequest
from gyrfalcon.frontend.serving_common import RequestError
from gyrfalcon.frontend.tool_grammar import parse_forced_calls
from gyrfalcon.frontend.tool_parsers import (
    TOOL_PARSERS,
    Delta,
    ToolCall,
    ToolCallStream,
    ToolParser,
    call_deltas,
    get_tool_parser,
)

FINISH_TOOL_CALLS = "tool_calls"


@dataclass(frozen=True)
class ToolCalling:
    """How one request's choices are read for tool calls: by `parser`, or (None)
    as a forced call's JSON."""

    parser: ToolParser | None
    named: str | None = None  # forced: the named function (None: "required")
    names: tuple[str, ...] = ()  # forced "required": the functions it may call
    parallel: bool = True

    @classmethod
    def of(cls, parser_name: str | None, req: ChatCompletionRequest) -> ToolCalling | None:
        """None when the output is plain content (no tools, or tool_choice "none");
        a 400 when the parser is to find the calls but the server has none."""
        if not req.parses_tool_calls:
            return None
        parallel = req.parallel_tool_calls is not False
        if req.forces_tool_call:
            names = tuple(t.function.name for t in req.tools or [])
            return cls(None, req.named_tool, names, parallel)
        if parser_name is None:
            raise RequestError(
                "this server parses no tool calls: start it with --tool-call-parser "
                f"({' or '.join(TOOL_PARSERS)}), or send tool_choice 'none', 'required' "
                "or a named function",
                param="tools",
            )
        return cls(get_tool_parser(parser_name), parallel=parallel)

    def skip_special_tokens(self, req: ChatCompletionRequest) -> bool:
        """The request's flag, unless it left it unset and the parser's markers
        may be special tokens."""
        if (
            self.parser is not None
            and self.parser.keeps_special_tokens
            and "skip_special_tokens" not in req.model_fields_set
        ):
            return False
        return req.skip_special_tokens

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """One choice's whole output -> (content, calls)."""
        if self.parser is not None:
            content, calls = self.parser.parse(text)
        else:
            forced = parse_forced_calls(text, self.named, self.names)
            content, calls = (text, []) if forced is None else (None, forced)
        return content, calls if self.parallel else calls[:1]

    def stream(self) -> ChoiceToolStream:
        return ChoiceToolStream(self)


@dataclass
class ChoiceToolStream:
    """One streamed choice: text deltas in, OpenAI deltas out, `called` once a
    call was sent."""

    calling: ToolCalling
    called: bool = False
    _stream: ToolCallStream | None = field(init=False)
    _text: list[str] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        # NOTE: a forced call is read once the output is whole
        parser = self.calling.parser
        self._stream = None if parser is None else parser.stream()

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
