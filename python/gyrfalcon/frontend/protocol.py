"""OpenAI-compatible HTTP request schemas (pydantic v2) and their engine mapping.

Requests mirror OpenAI's `/v1/chat/completions` and `/v1/completions` bodies,
plus the sampling extensions vLLM users expect (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, skip_special_tokens). Response
and stream-chunk models live in `protocol_responses.py`.

Types are strict (`"8"` or `true` is not a number; OpenAI rejects them too);
values outside their documented range are rejected. A JSON `null` for a field
with a default means "use the default", as in OpenAI's API. Fields the server
does not build yet are refused with a 400 naming them, and fields nobody
defines are ignored and named in one log line per request (protocol_fields.py).
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from gyrfalcon.frontend.protocol_fields import (
    ParamError,
    RequestModel,
    check_refused,
    check_text,
)
from gyrfalcon.frontend.protocol_structured import StructuredFields, check_structured
from gyrfalcon.frontend.protocol_tools import (
    ToolCallParam,
    ToolChoice,
    ToolParam,
    check_tool_choice,
)
from gyrfalcon.frontend.tool_grammar import check_forced_tools, forced_tool_output, forces_call
from gyrfalcon.ipc.messages import SamplingParams, StructuredOutput

MAX_N = 128  # choices per request (OpenAI's limit)
MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
MIN_PENALTY, MAX_PENALTY = -2.0, 2.0
MAX_STOP_STRINGS = 64
# NOTE: stop matching is linear in the output, but each held-back character is
# re-examined per stop string: bound the work a single request can ask for.
MAX_STOP_STRING_CHARS = 1024
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for each logit_bias value: [-100, 100]
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOP_K_DISABLED = -1

__all__ = ["ParamError"]  # re-exported: the schemas' validation errors


class _Body(RequestModel):
    """A whole request body: refused fields and invalid text are checked first."""

    # refused fields (protocol_fields.REFUSED) that this endpoint honours
    honoured: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _check_body(cls, data: Any) -> Any:
        if isinstance(data, dict):
            check_text(data)
            check_refused(data, cls.honoured)
        return data


class StreamOptions(RequestModel):
    include_usage: bool = False
    # vLLM's extension: every chunk carries the usage so far (with include_usage)
    continuous_usage_stats: bool = False


class SamplingRequest(_Body, StructuredFields):
    """Fields shared by chat and text completions (the structured-output ones:
    protocol_structured.py)."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=MIN_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=MIN_PENALTY, le=MAX_PENALTY)
    # token id (a decimal string, as JSON object keys are) -> bias added to its logit
    logit_bias: dict[str, float] | None = None
    # OpenAI fields that do not change the output: accepted as they are
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # chat with tools: False keeps the first call only (None: true)
    parallel_tool_calls: bool | None = None
    # vLLM-style extensions
    top_k: int = Field(TOP_K_DISABLED, ge=TOP_K_DISABLED)  # -1 or 0 = disabled
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_tokens: int = Field(0, ge=0)  # no EOS / stop id / stop string before this many
    allowed_token_ids: list[int] | None = None  # sample only among these
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check_shared(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise ParamError("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop_strings):
            raise ParamError(
                "stop", f"a stop string may have at most {MAX_STOP_STRING_CHARS} characters"
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise ParamError("stop_token_ids", "stop_token_ids must be non-negative")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ParamError("allowed_token_ids", "allowed_token_ids must not be empty")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError("min_tokens", "min_tokens must not exceed max_tokens")
        if self.prompt_logprobs is not None and self.stream:
            raise ParamError("prompt_logprobs", "prompt_logprobs is not available when streaming")
        _ = self.bias_by_id  # validates the keys and values
        return self

    @model_validator(mode="after")
    def _check_structured(self) -> SamplingRequest:
        check_structured(self.structured_sources())
        return self

    @property
    def bias_by_id(self) -> dict[int, float]:
        """`logit_bias` keyed by token id (ParamError on a bad key or value)."""
        out: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise ParamError("logit_bias", f"logit_bias key {key!r} is not a token id")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ParamError(
                    "logit_bias",
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]; "
                    f"got {bias} for token {key}",
                )
            out[int(key)] = bias
        return out

    @property
    def token_id_params(self) -> dict[str, list[int]]:
        """The token-id fields, by name, for the vocabulary check."""
        return {
            "stop_token_ids": self.stop_token_ids,
            "logit_bias": list(self.bias_by_id),
            "allowed_token_ids": self.allowed_token_ids or [],
        }

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings as a list; empty strings are dropped (they cannot stop)."""
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Every stream chunk carries the usage so far (vLLM: needs include_usage too)."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


# ---------------------------------------------------------------- chat


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    tool_calls: list[ToolCallParam] | None = None  # an assistant message: its calls

    @model_validator(mode="before")
    @classmethod
    def _only_text_parts(cls, data: Any) -> Any:
        content = data.get("content") if isinstance(data, dict) else None
        if isinstance(content, list):
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ParamError(
                        "messages",
                        f"content part type {kind!r} is not supported; only 'text' parts are",
                    )
        return data

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ParamError("messages", f"a {self.role} message must have content")
        if self.tool_calls and self.role != "assistant":
            raise ParamError(
                "messages", f"only assistant messages have tool_calls, not {self.role}"
            )
        return self

    @property
    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def to_template(self) -> dict[str, Any]:
        """The message as the chat template expects it (tool calls with their
        arguments as dicts: protocol_tools.ToolCallParam.to_template)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            out["tool_calls"] = [call.to_template() for call in self.tool_calls]
        return out


class ChatCompletionRequest(SamplingRequest):
    honoured: ClassVar[frozenset[str]] = frozenset({"tools", "tool_choice"})

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[ToolParam] | None = None
    # None: "auto" with tools, "none" without (OpenAI's defaults)
    tool_choice: ToolChoice | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _check_structured(self) -> ChatCompletionRequest:
        # NOTE: replaces SamplingRequest's validator of this name (and runs where it
        # would): the tools are checked before a forced call's grammar is built of them
        check_tool_choice(self.tools or [], self.tool_choice)
        check_forced_tools(self.tools or [], self.tool_choice)
        check_structured(self.structured_sources())
        return self

    def structured_sources(self) -> list[tuple[str, StructuredOutput]]:
        """The structured-output fields, and a tool_choice that forces a call
        (frontend/tool_grammar.py)."""
        sources = super().structured_sources()
        forced = forced_tool_output(
            self.tools or [], self.tool_choice, self.parallel_tool_calls is not False
        )
        return sources + [("tool_choice", forced)] if forced is not None else sources

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template takes them (OpenAI's dicts), or None."""
        return [t.to_template() for t in self.tools] if self.tools else None

    @property
    def parses_tool_calls(self) -> bool:
        """Whether the output is searched for tool calls: tools given, and a
        tool_choice other than "none"."""
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def forces_tool_call(self) -> bool:
        """tool_choice "required" or a named function: the call is forced by a grammar."""
        return bool(self.tools) and forces_call(self.tool_choice)

    @property
    def named_tool(self) -> str | None:
        """The function a named tool_choice asks for."""
        choice = self.tool_choice
        return choice.function.name if choice is not None and not isinstance(choice, str) else None

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` (the current name) wins over `max_tokens`."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


# ---------------------------------------------------------------- completions

Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if self.suffix:
            raise ParamError("suffix", "suffix is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ParamError("best_of", "best_of other than n is not supported")
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise ParamError("prompt", "prompt must not be empty")
            # NOTE: a validated prompt list is all ints, all texts or all lists: a
            # token-id prompt's ~1,000s of ints are not walked
            if isinstance(self.prompt[0], list) and not all(self.prompt):
                raise ParamError("prompt", "a token-id prompt must not be empty")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: each item is a text or a token-id list."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):  # NOTE: one token-id prompt (the list is all ints)
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


# ---------------------------------------------------------------- engine mapping


def to_sampling_params(
    req: ChatCompletionRequest | CompletionRequest, max_tokens: int
) -> SamplingParams:
    """Map a validated request onto the engine's sampling parameters.

    `max_tokens` is the resolved budget (defaults and context clamping are the
    serving layer's job). Logprob counts follow each endpoint's convention.
    """
    prompt_logprobs = req.prompt_logprobs
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
        if req.echo and req.logprobs is not None:  # echo reports the prompt's logprobs too
            prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
    return SamplingParams(
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=TOP_K_DISABLED if req.top_k == 0 else req.top_k,
        min_p=req.min_p,
        seed=req.seed,
        repetition_penalty=req.repetition_penalty,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        max_tokens=max_tokens,
        stop_token_ids=list(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        min_tokens=req.min_tokens,
        logit_bias=req.bias_by_id,
        allowed_token_ids=req.allowed_token_ids,
        structured=req.structured,
    )
