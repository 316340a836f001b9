"""A request's `StructuredOutput` as an xgrammar `Grammar`.

JSON is compact: no whitespace beyond the separators ", " and ": " (xgrammar's
`any_whitespace` off), so a model cannot pad its output with whitespace that never
ends; `json_object` is the schema {"type": "object"}.
"""

from __future__ import annotations

import json

import xgrammar as xgr

from gyrfalcon.ipc.messages import StructuredOutput

KINDS = ("json_object", "json_schema", "regex", "ebnf")
_SEPARATORS = (", ", ": ")


class GrammarError(ValueError):
    """A structured-output spec xgrammar cannot build: a client error (400)."""


def build_grammar(so: StructuredOutput) -> xgr.Grammar:
    """The grammar of `so`; GrammarError says what is wrong with it."""
    if so.kind not in KINDS:
        raise GrammarError(f"unknown structured output kind {so.kind!r}; one of {KINDS}")
    try:
        if so.kind in ("json_object", "json_schema"):
            schema = so.spec if so.kind == "json_schema" else '{"type": "object"}'
            return xgr.Grammar.from_json_schema(
                schema, any_whitespace=False, separators=_SEPARATORS, strict_mode=so.strict
            )
        if so.kind == "regex":
            return xgr.Grammar.from_regex(so.spec)
        return xgr.Grammar.from_ebnf(so.spec)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(f"invalid {so.kind}: {_first_line(exc)}") from None


def json_schema_output(schema: dict | bool | str, strict: bool = False) -> StructuredOutput:
    """The StructuredOutput of a JSON schema given as an object or its text."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    return StructuredOutput(kind="json_schema", spec=text, strict=strict)


def _first_line(exc: Exception) -> str:
    """xgrammar's message without its C++ location prefix ("[hh:mm:ss] file.cc:123: ")."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    head, sep, rest = text.partition(": ")
    return rest if sep and head.startswith("[") and ".cc:" in head else text
