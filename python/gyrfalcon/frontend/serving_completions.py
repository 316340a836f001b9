"""POST /v1/completions: prompt(s) -> engine requests -> response or SSE.

A list of prompts gives one choice per prompt and per n, choice index
prompt_index * n + i. `echo` puts the prompt before the completion; with
`logprobs` it also reports the prompt tokens' logprobs (the first is None).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass

import msgspec
from starlette.requests import Request

from gyrfalcon.frontend.logprob_formats import CompletionLogprobsBuilder, vllm_prompt_logprobs
from gyrfalcon.frontend.protocol import CompletionRequest, to_sampling_params
from gyrfalcon.frontend.protocol_responses import (
    CompletionChoice,
    CompletionResponse,
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

ID_PREFIX = "cmpl"
DEFAULT_MAX_TOKENS = 16  # OpenAI's default for text completions


@dataclass(frozen=True)
class _Prompt:
    ids: list[int]
    text: str  # what `echo` shows ("" without echo)


def _encode_prompts(ctx: ServingContext, req: CompletionRequest) -> list[_Prompt]:
    prompts = []
    for p in req.prompts():
        if isinstance(p, str):
            ids = ctx.tokenizer.encode(p)  # the tokenizer's default special tokens (BOS)
            text = p
        else:
            ctx.check_token_ids(p, "prompt")
            # NOTE: decoded for echo only: ~10% of the frontend's time a request otherwise
            ids, text = p, ctx.tokenizer.decode(p) if req.echo else ""
        if not ids:
            raise RequestError("the prompt is empty", param="prompt")
        prompts.append(_Prompt(ids, text))
    return prompts


async def create_completion(
    ctx: ServingContext, req: CompletionRequest, raw: Request
) -> CompletionResponse | AsyncIterator[str]:
    """Validate and submit; return the response, or the SSE stream if req.stream.

    All request errors (RequestError) are raised here, before any byte is sent.
    """
    ctx.check_request(req, "/v1/completions")
    prompts = _encode_prompts(ctx, req)
    request_id = new_id(ID_PREFIX)
    children = []
    for p_index, prompt in enumerate(prompts):
        max_tokens = ctx.resolve_max_tokens(
            len(prompt.ids), req.max_tokens, DEFAULT_MAX_TOKENS, prompt_param="prompt"
        )
        base = to_sampling_params(req, max_tokens)
        for i in range(req.n):
            index = p_index * req.n + i
            children.append(
                ChildSpec(
                    index,
                    f"{request_id}-{index}",
                    prompt.ids,
                    msgspec.structs.replace(base, seed=child_seed(base.seed, i)),
                )
            )
    texts = [prompts[c.index // req.n].text for c in children]
    usage_prompt = sum(len(p.ids) for p in prompts)  # each prompt counted once, whatever n
    if req.stream:
        return _stream(ctx, req, request_id, children, texts, usage_prompt, raw)
    return await _collect(ctx, req, request_id, children, texts, usage_prompt, raw)


async def _collect(
    ctx: ServingContext,
    req: CompletionRequest,
    request_id: str,
    children: list[ChildSpec],
    echo_texts: list[str],
    usage_prompt: int,
    raw: Request,
) -> CompletionResponse:
    results = [ChoiceResult(c.index) for c in children]
    tally = UsageTally.of(ctx, usage_prompt, len(children), req.n)
    deltas = stream_choices(ctx, children, req.stop_strings, req.skip_special_tokens, raw)
    async with aclosing(deltas):
        async for delta in deltas:
            raise_for_error(ctx, delta)
            results[delta.index].add(delta)
            tally.add(delta)
    choices = []
    for r, child, echo_text in zip(results, children, echo_texts):
        logprobs = prompt_logprobs = None
        if req.logprobs is not None:
            logprobs = CompletionLogprobsBuilder(ctx, req.logprobs).build(
                child.prompt_ids if req.echo else (), r.prompt_logprobs, r.logprobs
            )
        if req.prompt_logprobs is not None:
            prompt_logprobs = vllm_prompt_logprobs(
                ctx, child.prompt_ids, r.prompt_logprobs, req.prompt_logprobs
            )
        text = echo_text + r.text if req.echo else r.text
        choices.append(
            CompletionChoice(
                index=r.index,
                text=text,
                logprobs=logprobs,
                finish_reason=r.finish_reason,
                prompt_logprobs=prompt_logprobs,
            )
        )
    return CompletionResponse(
        id=request_id,
        created=now(),
        model=ctx.model_name,
        choices=choices,
        usage=tally.usage(),
    )


async def _stream(
    ctx: ServingContext,
    req: CompletionRequest,
    request_id: str,
    children: list[ChildSpec],
    echo_texts: list[str],
    usage_prompt: int,
    raw: Request,
) -> AsyncIterator[str]:
    created = now()

    def chunk(choices: list[CompletionChoice], usage: UsageInfo | None = None) -> str:
        return sse(
            CompletionResponse(
                id=request_id, created=created, model=ctx.model_name, choices=choices, usage=usage
            )
        )

    builders = [CompletionLogprobsBuilder(ctx, req.logprobs or 0) for _ in children]
    started = [False] * len(children)
    tally = UsageTally.of(ctx, usage_prompt, len(children), req.n)
    deltas = stream_choices(ctx, children, req.stop_strings, req.skip_special_tokens, raw)
    try:
        async with aclosing(deltas):
            async for delta in deltas:
                raise_for_error(ctx, delta)
                i = delta.index
                tally.add(delta)
                echo = req.echo and not started[i]
                started[i] = True
                text = echo_texts[i] + delta.text if echo else delta.text
                logprobs = None
                if req.logprobs is not None:
                    logprobs = builders[i].build(
                        children[i].prompt_ids if echo else (),
                        delta.prompt_logprobs,
                        delta.logprobs or (),
                    )
                if not (text or (logprobs and logprobs.tokens) or delta.finished):
                    continue
                usage = None
                if req.continuous_usage:
                    usage = tally.usage()
                yield chunk(
                    [
                        CompletionChoice(
                            index=i, text=text, logprobs=logprobs, finish_reason=delta.finish_reason
                        )
                    ],
                    usage,
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
