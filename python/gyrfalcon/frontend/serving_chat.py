"""POST /v1/chat/completions: chat template -> engine requests -> response or SSE."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request

from gyrfalcon.frontend.logprob_formats import chat_logprobs, vllm_prompt_logprobs
from gyrfalcon.frontend.protocol import ChatCompletionRequest, ChatMessage, to_sampling_params
from gyrfalcon.frontend.protocol_responses import (
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatDelta,
    ChatResponseMessage,
    ChatToolCall,
    FunctionCall,
    UsageInfo,
    new_id,
    now,
)
from gyrfalcon.frontend.serving_common import (
    SSE_DONE,
    ChildSpec,
    ChoiceResult,
    ClientDisconnected,
    RequestError,
    ServingContext,
    UsageTally,
    child_seed,
    raise_for_error,
    sse,
    stream_choices,
)
from gyrfalcon.frontend.serving_tools import ChoiceToolStream, ToolCalling, finish_reason
from gyrfalcon.frontend.tool_parsers import new_call_id

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

ID_PREFIX = "chatcmpl"


def render_chat_prompt(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[ChatMessage],
    chat_template_kwargs: dict[str, bool] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Apply the model's chat template (with the generation prompt) and tokenize.

    `chat_template_kwargs` override `apply_chat_template`'s flags (by default
    `add_generation_prompt=True`), e.g. `continue_final_message` for /tokenize.
    `tools` (OpenAI's tool dicts) go to the template, which writes them into the
    prompt if it knows how (a template without tool support leaves them out).
    NOTE: the template already writes any BOS/special tokens, so encoding adds none.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template; use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(
            [m.to_template() for m in messages],
            tools=tools,
            tokenize=False,
            **{"add_generation_prompt": True, **(chat_template_kwargs or {})},
        )
    except Exception as exc:  # templates reject bad conversations by raising
        raise RequestError(
            f"the chat template rejected the messages: {exc}", param="messages"
        ) from exc
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise RequestError("the rendered prompt is empty", param="messages")
    return ids


async def create_chat_completion(
    ctx: ServingContext, req: ChatCompletionRequest, raw: Request
) -> ChatCompletionResponse | AsyncIterator[str]:
    """Validate and submit; return the response, or the SSE stream if req.stream.

    All request errors (RequestError) are raised here, before any byte is sent.
    """
    ctx.check_request(req, "/v1/chat/completions")
    tools = ToolCalling.of(ctx.tool_call_parser, req)
    # NOTE: as in vLLM, tools are in the prompt with tool_choice "none" too
    prompt_ids = render_chat_prompt(ctx.tokenizer, req.messages, tools=req.template_tools)
    max_tokens = ctx.resolve_max_tokens(
        len(prompt_ids), req.requested_max_tokens, default=None, prompt_param="messages"
    )
    base = to_sampling_params(req, max_tokens)
    request_id = new_id(ID_PREFIX)
    children = [
        ChildSpec(
            i,
            f"{request_id}-{i}",
            prompt_ids,
            msgspec.structs.replace(base, seed=child_seed(base.seed, i)),
        )
        for i in range(req.n)
    ]
    if req.stream:
        return _stream(ctx, req, request_id, children, raw, tools)
    return await _collect(ctx, req, request_id, children, raw, tools)


def _choice(
    ctx: ServingContext, req: ChatCompletionRequest, r: ChoiceResult, tools: ToolCalling | None
) -> ChatCompletionChoice:
    content, calls = (r.text, []) if tools is None else tools.parse(r.text)
    message = ChatResponseMessage(
        content=content,
        tool_calls=[
            ChatToolCall(
                id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments)
            )
            for c in calls
        ]
        or None,
    )
    return ChatCompletionChoice(
        index=r.index,
        message=message,
        logprobs=chat_logprobs(ctx, r.logprobs) if req.logprobs else None,
        finish_reason=finish_reason(r.finish_reason, bool(calls)),
    )


def _skip_special_tokens(req: ChatCompletionRequest, tools: ToolCalling | None) -> bool:
    return req.skip_special_tokens if tools is None else tools.skip_special_tokens(req)


async def _collect(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    request_id: str,
    children: list[ChildSpec],
    raw: Request,
    tools: ToolCalling | None,
) -> ChatCompletionResponse:
    results = [ChoiceResult(c.index) for c in children]
    tally = UsageTally.of(ctx, len(children[0].prompt_ids), len(children))
    skip_special = _skip_special_tokens(req, tools)
    deltas = stream_choices(ctx, children, req.stop_strings, skip_special, raw)
    async with aclosing(deltas):
        async for delta in deltas:
            raise_for_error(ctx, delta)
            results[delta.index].add(delta)
            tally.add(delta)
    choices = [_choice(ctx, req, r, tools) for r in results]
    prompt_ids = children[0].prompt_ids
    prompt_logprobs = None
    if req.prompt_logprobs is not None:
        prompt_logprobs = vllm_prompt_logprobs(
            ctx, prompt_ids, results[0].prompt_logprobs, req.prompt_logprobs
        )
    return ChatCompletionResponse(
        id=request_id,
        created=now(),
        model=ctx.model_name,
        choices=choices,
        usage=tally.usage(),
        prompt_logprobs=prompt_logprobs,
    )


async def _stream(
    ctx: ServingContext,
    req: ChatCompletionRequest,
    request_id: str,
    children: list[ChildSpec],
    raw: Request,
    tools: ToolCalling | None,
) -> AsyncIterator[str]:
    created = now()
    parsers: dict[int, ChoiceToolStream] = (
        {} if tools is None else {c.index: tools.stream() for c in children}
    )

    tally = UsageTally.of(ctx, len(children[0].prompt_ids), len(children))

    def chunk(choices: list[ChatCompletionStreamChoice], usage: UsageInfo | None = None) -> str:
        if usage is None and choices and req.continuous_usage:
            usage = tally.usage()
        return sse(
            ChatCompletionChunk(
                id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage
            )
        )

    for c in children:
        yield chunk(
            [
                ChatCompletionStreamChoice(
                    index=c.index, delta=ChatDelta(role="assistant", content="")
                )
            ]
        )
    skip_special = _skip_special_tokens(req, tools)
    deltas = stream_choices(ctx, children, req.stop_strings, skip_special, raw)
    try:
        async with aclosing(deltas):
            async for delta in deltas:
                raise_for_error(ctx, delta)
                tally.add(delta)
                parser = parsers.get(delta.index)
                reason = delta.finish_reason
                if parser is None:
                    pieces = [ChatDelta(content=delta.text)] if delta.text else []
                else:
                    found = parser.feed(delta.text) + (parser.finish() if delta.finished else [])
                    pieces = [ChatDelta.model_validate(d) for d in found]
                    reason = finish_reason(reason, parser.called)
                if not (pieces or delta.logprobs or delta.finished):
                    continue
                logprobs = chat_logprobs(ctx, delta.logprobs or []) if req.logprobs else None
                pieces = pieces or [ChatDelta()]
                # NOTE: one output may make several deltas (text, then a call's parts):
                # its logprobs go with the first, the finish reason with the last
                for k, piece in enumerate(pieces):
                    last = k == len(pieces) - 1
                    yield chunk(
                        [
                            ChatCompletionStreamChoice(
                                index=delta.index,
                                delta=piece,
                                logprobs=logprobs if k == 0 else None,
                                finish_reason=reason if last else None,
                            )
                        ]
                    )
    except ClientDisconnected:
        return
    except RequestError as err:  # headers are sent: report in-band, then end
        yield sse(err.body())
        yield SSE_DONE
        return
    if req.include_usage:
        yield chunk([], tally.usage())
    yield SSE_DONE
