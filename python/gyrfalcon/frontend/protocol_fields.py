"""Which request fields the server honours, refuses or ignores, and the checks
that run on a raw request body before the schemas see it.

Every field a client may send falls in one of four groups:

- a declared field of the request schema: honoured (or, for the few OpenAI
  fields that do not change the output, such as `user`, accepted as is);
- REFUSED: defined by OpenAI, SGLang or vLLM, not built here yet (or not for
  this endpoint); a value that would change the output is a 400 naming the field;
- anything else: ignored, and named in one log line per request.

`RequestModel` is the base of every request schema: strict types, `null` for a
field with a default means the default, and unknown fields are kept only to be
named in that log line.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


class ParamError(ValueError):
    """A semantically invalid request field; `param` names it for the error body."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def _set(value: Any) -> bool:
    return value is not None


def _non_empty(value: Any) -> bool:
    return value is not None and value != [] and value != {}


def _true(value: Any) -> bool:
    return value is True


def _not_none_choice(value: Any) -> bool:
    return value is not None and value != "none"


def _not_text_only(value: Any) -> bool:
    return value is not None and value != ["text"]


# field -> (is the value one that would change the output?, what to tell the client)
_TOOLS = "tool calling is only available in /v1/chat/completions"
_FUNCTIONS = "the deprecated `functions` / `function_call` are not supported; send `tools`"
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # NOTE: honoured by chat completions (`ChatCompletionRequest.honoured`)
    "tools": (_non_empty, _TOOLS),
    "tool_choice": (_not_none_choice, _TOOLS),
    "functions": (_non_empty, _FUNCTIONS),
    "function_call": (_not_none_choice, _FUNCTIONS),
    "use_beam_search": (_true, "beam search is not supported"),
    "audio": (_set, "audio output is not supported"),
    "modalities": (_not_text_only, "only the 'text' modality is supported"),
    "prediction": (_set, "predicted outputs are not supported"),
    "web_search_options": (_set, "web search is not supported"),
}


def check_refused(data: dict[str, Any], honoured: Collection[str] = ()) -> None:
    """400 (ParamError) for the first refused field whose value would change the
    output; the fields in `honoured` are the endpoint's own (chat's `tools`)."""
    for name, (active, why) in REFUSED.items():
        if name in data and name not in honoured and active(data[name]):
            raise ParamError(name, f"`{name}` is not supported by this server: {why}")


class RequestModel(BaseModel):
    """The base of the request schemas (and of their nested objects)."""

    # NOTE: extra="allow" keeps unknown fields in `model_extra`, so that
    # `unknown_fields()` can name them in a log line; they never reach the engine.
    model_config = ConfigDict(extra="allow", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {
            k: v
            for k, v in data.items()
            if not (v is None and k in fields and fields[k].default is not None)
        }

    def unknown_fields(self, prefix: str = "") -> list[str]:
        """Paths of the fields this schema (and its nested ones) does not define."""
        out = [f"{prefix}{k}" for k in self.model_extra or {} if k not in REFUSED]
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, list) and value and isinstance(value[0], int):
                continue  # NOTE: token ids (a validated list is all ints): no model inside
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                if isinstance(item, RequestModel):
                    where = f"{name}[{i}]" if isinstance(value, list) else name
                    out += item.unknown_fields(f"{prefix}{where}.")
        return out


def check_text(value: Any, path: str = "") -> None:
    """400 for a string holding a lone UTF-16 surrogate (JSON allows `"\\ud800"`;
    no tokenizer can encode it), anywhere in a parsed JSON body."""
    for where, text in _strings(value, path):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ParamError(
                where or None,
                f"{where or 'the request'} holds a lone UTF-16 surrogate at character "
                f"{exc.start}; send valid Unicode",
            ) from None


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    if isinstance(value, str):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str):
                yield from _strings(key, path)
            yield from _strings(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        # NOTE: a token-id prompt is a list of ~1,000s of ints: one C-speed pass over it,
        # and no path built for its items
        if value and isinstance(value[0], int) and all(type(x) is int for x in value):
            return
        for i, item in enumerate(value):
            if isinstance(item, (str, dict, list)):
                yield from _strings(item, f"{path}[{i}]")
