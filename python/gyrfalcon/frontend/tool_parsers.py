"""Tool-call parsers (`--tool-call-parser`): a model's text -> OpenAI tool calls.

Each parser knows one family's syntax:

- `hermes` (Hermes, Qwen 2.5 / 3): calls are blocks
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any number,
  with text around them;
- `llama3_json` (Llama 3.1 / 3.2 / 3.3): the whole output is
  `{"name": ..., "parameters": {...}}` (or "arguments"), optionally after
  `<|python_tag|>`, several calls separated by `;`.

A parser's scanner turns text, in deltas of any size, into events: text to
show as content, or a whole `ToolCall`. The full-text parse is the scanner fed
at once, so a streamed response holds the same calls and content as the
non-streamed one. Text that may be the start of a call is held back, not sent
as content. A call is sent once it is complete (its arguments in one piece):
only then is it known to be valid JSON; a malformed one stays content.
Whitespace around a call is dropped, but for what separated the text before it
from the text after it.
"""

from __future__ import annotations

import json
import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

TOOL_CALL_ID_PREFIX = "call_"

# An OpenAI streaming delta: {"content": ...} or {"tool_calls": [...]}
Delta = dict[str, Any]


def new_call_id() -> str:
    """A fresh tool-call id such as `call_3f2a...` (24 hex digits)."""
    return TOOL_CALL_ID_PREFIX + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


# What a scanner makes of text: content to show, or a complete call.
Event = str | ToolCall


def call_from_object(obj: Any) -> ToolCall | None:
    """The call `{"name": ..., "arguments" | "parameters": {...}}` describes, or None.

    Arguments may be an object or a JSON string holding one (some models write
    that); absent ones are `{}`.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def call_from_json(text: str) -> ToolCall | None:
    """`call_from_object` of a JSON text (None if it is not JSON)."""
    try:
        return call_from_object(json.loads(text))
    except ValueError:
        return None


def call_deltas(index: int, call: ToolCall) -> list[Delta]:
    """The streaming deltas of one call: its id, type and name, then its arguments."""
    head = {
        "index": index,
        "id": new_call_id(),
        "type": "function",
        "function": {"name": call.name},
    }
    args = {"index": index, "function": {"arguments": call.arguments}}
    return [{"tool_calls": [head]}, {"tool_calls": [args]}]


class Scanner(ABC):
    """One choice's text, in deltas, into events."""

    @abstractmethod
    def feed(self, text: str) -> list[Event]:
        """The events this text completes (held-back text waits for later)."""

    @abstractmethod
    def finish(self) -> list[Event]:
        """The end of the output: every held-back text is decided."""


class ToolCallStream:
    """One choice's text deltas in, OpenAI streaming deltas out (calls numbered
    from 0 in order)."""

    def __init__(self, scanner: Scanner) -> None:
        self._scanner = scanner
        self.num_calls = 0

    def feed(self, text: str) -> list[Delta]:
        return self._deltas(self._scanner.feed(text)) if text else []

    def finish(self) -> list[Delta]:
        return self._deltas(self._scanner.finish())

    def _deltas(self, events: list[Event]) -> list[Delta]:
        out: list[Delta] = []
        for event in events:
            if isinstance(event, ToolCall):
                out += call_deltas(self.num_calls, event)
                self.num_calls += 1
            elif out and "content" in out[-1]:
                out[-1]["content"] += event
            elif event:
                out.append({"content": event})
        return out


class ToolParser(ABC):
    """One family's tool-call syntax."""

    name: ClassVar[str]
    # NOTE: the markers are special tokens in some vocabularies (vLLM's hermes
    # parser turns skip_special_tokens off for the same reason)
    keeps_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def scanner(self) -> Scanner:
        """A fresh scanner for one choice."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole output -> (content, calls); content is None when calls took
        all of it, and the text itself when there is no call."""
        scanner = self.scanner()
        events = scanner.feed(text) + scanner.finish()
        calls = [e for e in events if isinstance(e, ToolCall)]
        content = "".join(e for e in events if isinstance(e, str))
        return (content or None) if calls else content, calls

    def stream(self) -> ToolCallStream:
        return ToolCallStream(self.scanner())


# ---------------------------------------------------------------- hermes


def _held_length(text: str, marker: str) -> int:
    """How much of text's end to hold back: a proper prefix of `marker` (the
    longest) and the whitespace before it, which a call would drop."""
    k = next((k for k in range(min(len(text), len(marker) - 1), 0, -1)
              if marker.startswith(text[-k:])), 0)  # fmt: skip
    body = text[: len(text) - k]
    return k + len(body) - len(body.rstrip())


class HermesScanner(Scanner):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""
        self._in_call = False
        self._gap = ""  # whitespace before the open call
        # NOTE: a valid call's gap separates the text before it from the text after
        # it (whitespace right after a call is dropped); with no text on either side
        # it is dropped too
        self._separator = ""
        self._after_call = False
        self._wrote = False  # any content yet

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while True:
            if self._in_call:
                end = self._buf.find(self.END)
                if end < 0:
                    return out
                out += self._close(self._buf[:end], closed=True)
                self._buf = self._buf[end + len(self.END) :]
                continue
            start = self._buf.find(self.START)
            if start < 0:
                cut = len(self._buf) - _held_length(self._buf, self.START)
                out += self._text(self._buf[:cut])
                self._buf = self._buf[cut:]
                return out
            before = self._buf[:start]
            kept = before.rstrip()
            out += self._text(kept)
            self._gap = before[len(kept) :]
            self._buf = self._buf[start + len(self.START) :]
            self._in_call = True

    def finish(self) -> list[Event]:
        # NOTE: a last call the model did not close (it stopped right after the
        # JSON) still counts, as in vLLM
        out = self._close(self._buf, closed=False) if self._in_call else self._text(self._buf)
        self._buf = ""
        return out

    def _close(self, body: str, closed: bool) -> list[Event]:
        self._in_call = False
        gap, self._gap = self._gap, ""
        call = call_from_json(body)
        if call is None:  # not a call: the block stays as the model wrote it
            return self._text(gap + self.START + body + (self.END if closed else ""))
        if self._wrote:
            self._separator = self._separator or gap
        self._after_call = True
        return [call]

    def _text(self, text: str) -> list[Event]:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return []
            self._after_call = False
        if not text:
            return []
        text, self._separator = self._separator + text, ""
        self._wrote = True
        return [text]


class HermesToolParser(ToolParser):
    name = "hermes"
    keeps_special_tokens = True

    def scanner(self) -> Scanner:
        return HermesScanner()


# ---------------------------------------------------------------- llama3_json


def parse_json_calls(text: str, tag: str) -> list[ToolCall] | None:
    """`[tag] call (; call)*` (whitespace around each part) -> the calls, or None
    if any part is not a call."""
    s = text.strip()
    if s.startswith(tag):
        s = s[len(tag) :]
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while True:
        while pos < len(s) and s[pos].isspace():
            pos += 1
        try:
            obj, pos = decoder.raw_decode(s, pos)
        except ValueError:
            return None
        call = call_from_object(obj)
        if call is None:
            return None
        calls.append(call)
        rest = s[pos:].lstrip()
        if not rest.strip(";").strip():  # the end (a trailing `;` is allowed)
            return calls
        if not rest.startswith(";"):
            return None
        pos = len(s) - len(rest) + 1


class Llama3JsonScanner(Scanner):
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buf = ""
        self._mode = "undecided"  # then "text" (all content) or "calls" (held to the end)

    def feed(self, text: str) -> list[Event]:
        if self._mode == "text":
            return [text]
        self._buf += text
        if self._mode == "undecided":
            head = self._buf.lstrip()
            if head.startswith(("{", self.TAG)):
                self._mode = "calls"
            elif head and not self.TAG.startswith(head):
                self._mode = "text"
                return self._release()
        return []

    def finish(self) -> list[Event]:
        if self._mode == "calls":
            calls = parse_json_calls(self._buf, self.TAG)
            if calls:
                self._buf = ""
                return list(calls)
        return self._release()

    def _release(self) -> list[Event]:
        text, self._buf = self._buf, ""
        return [text] if text else []


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def scanner(self) -> Scanner:
        return Llama3JsonScanner()


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser `--tool-call-parser name` picks (ValueError for an unknown name)."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
