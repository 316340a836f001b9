"""OpenAI-compatible HTTP response, stream-chunk and error schemas (pydantic v2)."""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer


def new_id(prefix: str) -> str:
    """A fresh response id such as `chatcmpl-3f2a...`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """The `created` timestamp: Unix seconds."""
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    """OpenAI's usage, with `prompt_tokens_details.cached_tokens` where the server
    caches prefixes; a server with speculative decoding adds `spec_accept_length`
    (mean tokens emitted per verify step: accepted drafts + 1; 1.0 before any) and
    `spec_verify_steps` (steps that verified drafts), over every choice."""

    # NOTE: the spec fields are extras, so other servers' usage keeps OpenAI's keys only
    model_config = ConfigDict(extra="allow")

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(
        cls,
        prompt_tokens: int,
        completion_tokens: int,
        spec: tuple[int, int] | None = None,
        cached_tokens: int | None = None,
    ) -> UsageInfo:
        """spec: (verify steps, accepted drafts) of a speculative server's response;
        cached_tokens: of a server that caches prefixes."""
        usage = cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )
        if cached_tokens is not None:
            usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached_tokens)
        if spec is not None:
            steps, accepted = spec
            usage.spec_accept_length = (steps + accepted) / steps if steps else 1.0
            usage.spec_verify_steps = steps
        return usage


class PromptLogprob(BaseModel):
    """One token of a prompt position in vLLM's `prompt_logprobs` shape."""

    logprob: float
    rank: int | None = None  # 1 = the most probable token
    decoded_token: str | None = None


# vLLM's `prompt_logprobs`: per prompt position (the first has none), the prompt's
# token and the top-k tokens, keyed by token id.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


# ---------------------------------------------------------------- chat


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class _Compact(BaseModel):
    """Leaves the fields in `omitted_if_none` out of the JSON while they are None
    (a response without tool calls keeps OpenAI's shape without the key)."""

    omitted_if_none: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None or k not in self.omitted_if_none}


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ChatToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Compact):
    omitted_if_none = frozenset({"tool_calls"})

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ChatToolCall] | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension


class DeltaFunctionCall(_Compact):
    omitted_if_none = frozenset({"name", "arguments"})

    name: str | None = None  # in a call's first delta
    arguments: str | None = None  # in the deltas after it


class DeltaToolCall(_Compact):
    """One call's part in a stream chunk: its first delta has the id, type and name."""

    omitted_if_none = frozenset({"id", "type", "function"})

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatDelta(_Compact):
    omitted_if_none = frozenset({"tool_calls"})

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------- completions


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension


class CompletionResponse(BaseModel):
    """Both the whole response and (with `usage` None) one stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------- models, errors


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "gyrfalcon"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
