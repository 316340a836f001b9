"""OpenAI-compatible HTTP request schemas (pydantic v2) and their engine mapping.

Requests mirror OpenAI's `/v1/chat/completions` and `/v1/completions` bodies,
plus the sampling extensions vLLM users expect (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, skip_special_tokens). Response
and stream-chunk models live in `protocol_responses.py`.

Unknown fields are ignored (clients send fields we do not implement, such as
`user` metadata); values outside their documented range are rejected. A JSON
`null` for a field with a default means "use the default", as in OpenAI's API.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, model_validator

from gyrfalcon.ipc.messages import SamplingParams

MAX_N = 128  # choices per request (OpenAI's limit)
MAX_TOP_LOGPROBS = 20
MAX_TEMPERATURE = 2.0
MIN_PENALTY, MAX_PENALTY = -2.0, 2.0
MAX_STOP_STRINGS = 64
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOP_K_DISABLED = -1


class ParamError(ValueError):
    """A semantically invalid request field; `param` names it for the error body."""

    def __init__(self, param: str | None, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

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


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(_Request):
    """Fields shared by chat and text completions."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    max_tokens: int | None = Field(None, ge=1)
    stop: StrictStr | list[StrictStr] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float = Field(0.0, ge=MIN_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=MIN_PENALTY, le=MAX_PENALTY)
    user: str | None = None
    # vLLM-style extensions
    top_k: int = Field(TOP_K_DISABLED, ge=TOP_K_DISABLED)  # -1 or 0 = disabled
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_shared(self) -> SamplingRequest:
        if self.stream_options is not None and not self.stream:
            raise ParamError("stream_options", "stream_options is only allowed when stream is true")
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise ParamError("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed")
        if any(t < 0 for t in self.stop_token_ids):
            raise ParamError("stop_token_ids", "stop_token_ids must be non-negative")
        return self

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


# ---------------------------------------------------------------- chat


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

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
        return self

    @property
    def text(self) -> str:
        """The content as one string (text parts joined by newlines)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)

    def to_template(self) -> dict[str, str]:
        """The message as the chat template expects it."""
        out = {"role": self.role, "content": self.text}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ParamError("top_logprobs", "top_logprobs requires logprobs to be true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """`max_completion_tokens` (the current name) wins over `max_tokens`."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


# ---------------------------------------------------------------- completions

Prompt = StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if self.suffix:
            raise ParamError("suffix", "suffix is not supported")
        if isinstance(self.prompt, list):
            if not self.prompt:
                raise ParamError("prompt", "prompt must not be empty")
            if any(isinstance(p, list) and not p for p in self.prompt):
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
        if all(isinstance(x, int) for x in p):
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
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = req.logprobs
        prompt_logprobs = req.logprobs if req.echo else None
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
    )
