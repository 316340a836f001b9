"""What chat and text completions share: the serving context, request errors,
context-length rules, SSE framing, and the fan-out of one HTTP request into
several engine requests (n choices, several prompts) with abort on disconnect.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel
from starlette.requests import Request

from gyrfalcon.frontend.detokenizer import TokenTexts
from gyrfalcon.frontend.engine_client import FINISH_ERROR, EngineClient, EngineDeadError
from gyrfalcon.frontend.protocol import SamplingRequest
from gyrfalcon.frontend.protocol_responses import (
    ErrorInfo,
    ErrorResponse,
    UsageInfo,
)
from gyrfalcon.frontend.sequence import ChoiceDelta, SequenceDecoder
from gyrfalcon.ipc.messages import PositionLogprobs, SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from gyrfalcon.frontend.metrics import ServingMetrics

logger = logging.getLogger(__name__)

ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
    HTTPStatus.GATEWAY_TIMEOUT: "TimeoutError",
}
SSE_DONE = "data: [DONE]\n\n"
RETRY_AFTER_S = 1  # what a 503 for a full server asks clients to wait
_UINT64 = 2**64
_INT64_MIN = -(2**63)


class RequestError(Exception):
    """A request that cannot be served; becomes an OpenAI-shaped error body."""

    def __init__(
        self,
        message: str,
        status: HTTPStatus = HTTPStatus.BAD_REQUEST,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers or {}

    def body(self) -> ErrorResponse:
        return error_body(self.status, self.message, self.param)


class ClientDisconnected(Exception):
    """The HTTP client went away; its engine requests were aborted."""


def error_body(status: HTTPStatus, message: str, param: str | None = None) -> ErrorResponse:
    kind = ERROR_TYPES.get(status, "InternalServerError")
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=int(status)))


async def send_error(
    send: Any, status: HTTPStatus, message: str, headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """An OpenAI-shaped error as a whole ASGI response (middleware answering before
    the app: frontend/auth.py, frontend/body_limit.py)."""
    body = error_body(status, message).model_dump_json().encode()
    head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": int(status), "headers": head + [*headers]})
    await send({"type": "http.response.body", "body": body})


def sse(payload: BaseModel) -> str:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {payload.model_dump_json()}\n\n"


@dataclass
class ServingContext:
    """Everything a handler needs besides the request itself."""

    engine: EngineClient
    tokenizer: PreTrainedTokenizerBase
    model_name: str
    # None: the engine's context length, known once it reports EngineReady
    max_model_len_override: int | None = None
    metrics: ServingMetrics | None = None  # what each request adds to /metrics
    log_requests: bool = False  # a log line per request as it arrives and as it ends
    request_timeout: float | None = None  # seconds a request may take (None: no limit)
    tool_call_parser: str | None = None  # --tool-call-parser (None: tools are refused)
    token_texts: TokenTexts = field(init=False)
    vocab_size: int = field(init=False)

    def __post_init__(self) -> None:
        self.token_texts = TokenTexts(self.tokenizer)
        self.vocab_size = len(self.tokenizer)

    @property
    def max_model_len(self) -> int:
        if self.max_model_len_override is not None:
            return self.max_model_len_override
        assert self.engine.info is not None, "engine not ready"
        return self.engine.info.max_model_len

    def check_model(self, model: str | None) -> None:
        """404 unless `model` is absent or names the served model."""
        if model is not None and model != self.model_name:
            raise RequestError(
                f"The model `{model}` does not exist; this server serves `{self.model_name}`.",
                HTTPStatus.NOT_FOUND,
                param="model",
            )

    def check_engine(self) -> None:
        """503 while the engine is loading or after it died."""
        if self.engine.dead is not None:
            raise RequestError(
                f"engine is dead: {self.engine.dead}", HTTPStatus.SERVICE_UNAVAILABLE
            )
        if not self.engine.ready.is_set():
            raise RequestError("engine is not ready yet", HTTPStatus.SERVICE_UNAVAILABLE)

    def check_token_ids(self, ids: Sequence[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param=param
            )

    def check_request(self, req: SamplingRequest, endpoint: str) -> None:
        """What every generation request checks before its prompt is built: the model
        name, the engine, token ids against the vocabulary; unknown fields are logged."""
        self.check_model(req.model)
        self.check_engine()
        for param, ids in req.token_id_params.items():
            self.check_token_ids(ids, param)
        unknown = req.unknown_fields()
        if unknown:
            logger.warning("%s: ignoring fields no API defines: %s", endpoint, ", ".join(unknown))

    def resolve_max_tokens(
        self, prompt_len: int, requested: int | None, default: int | None, prompt_param: str
    ) -> int:
        """The output budget: `requested` if it fits, else `default` (None = all
        the room left), clamped so prompt + output never passes max_model_len."""
        if prompt_len >= self.max_model_len:
            raise RequestError(
                f"the prompt has {prompt_len} tokens; this model's context length is "
                f"{self.max_model_len}, so no room is left for output",
                param=prompt_param,
            )
        room = self.max_model_len - prompt_len
        if requested is not None:
            if requested > room:
                raise RequestError(
                    f"max_tokens={requested} plus the prompt's {prompt_len} tokens exceeds the "
                    f"context length {self.max_model_len}",
                    param="max_tokens",
                )
            return requested
        return room if default is None else min(default, room)


def child_seed(seed: int | None, i: int) -> int | None:
    """The seed of choice i: seed + i, wrapped into the int64 range."""
    if seed is None:
        return None
    return (seed + i - _INT64_MIN) % _UINT64 + _INT64_MIN


@dataclass(frozen=True)
class ChildSpec:
    """One engine request of a fanned-out HTTP request."""

    index: int
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams


@dataclass
class UsageTally:
    """A response's usage, from its choices' deltas (each delta carries its choice's
    counts so far); the spec fields when the engine decodes speculatively, the cached
    prompt tokens when it caches prefixes (the most of the `per_prompt` choices of
    one prompt, summed over the prompts, as prompt_tokens counts each prompt once)."""

    num_prompt: int
    spec: bool
    tokens: list[int]
    verify_steps: list[int]
    accepted: list[int]
    cached: list[int] | None = None
    per_prompt: int = 1

    @classmethod
    def of(
        cls, ctx: ServingContext, num_prompt: int, num_choices: int, per_prompt: int | None = None
    ) -> UsageTally:
        """per_prompt: consecutive choices that share one prompt (default: all)."""
        info = ctx.engine.info
        spec = info is not None and info.num_draft_tokens > 0
        zeros = [0] * num_choices
        cached = list(zeros) if info is not None and info.prefix_caching else None
        group = per_prompt or max(1, num_choices)
        return cls(num_prompt, spec, list(zeros), list(zeros), list(zeros), cached, group)

    def add(self, delta: ChoiceDelta) -> None:
        i = delta.index
        self.tokens[i] = max(self.tokens[i], delta.num_output_tokens)
        self.verify_steps[i] = max(self.verify_steps[i], delta.num_verify_steps)
        self.accepted[i] = max(self.accepted[i], delta.num_accepted)
        if self.cached is not None:
            self.cached[i] = max(self.cached[i], delta.num_cached_tokens)

    def usage(self) -> UsageInfo:
        spec = (sum(self.verify_steps), sum(self.accepted)) if self.spec else None
        cached = None
        if self.cached is not None:
            g = self.per_prompt
            cached = sum(max(self.cached[i : i + g]) for i in range(0, len(self.cached), g))
        return UsageInfo.of(self.num_prompt, sum(self.tokens), spec, cached)


@dataclass
class ChoiceResult:
    """A choice accumulated from its deltas (non-streaming responses)."""

    index: int
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def add(self, delta: ChoiceDelta) -> None:
        self.texts.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            self.finish_reason, self.error = delta.finish_reason, delta.error


def raise_for_error(ctx: ServingContext, delta: ChoiceDelta) -> None:
    """Turn a choice that ended in "error" into the HTTP error to report."""
    if delta.finish_reason != FINISH_ERROR:
        return
    if ctx.engine.dead is not None:
        raise RequestError(f"engine is dead: {ctx.engine.dead}", HTTPStatus.SERVICE_UNAVAILABLE)
    if delta.error_status == HTTPStatus.SERVICE_UNAVAILABLE:  # full: come back later
        headers = {"Retry-After": str(RETRY_AFTER_S)}
        raise RequestError(str(delta.error), HTTPStatus.SERVICE_UNAVAILABLE, headers=headers)
    # NOTE: with the engine alive, a per-request error is the engine refusing
    # this request (e.g. it can never fit in the KV cache): the client's side.
    raise RequestError(f"the engine rejected the request: {delta.error}")


async def stream_choices(
    ctx: ServingContext,
    children: Sequence[ChildSpec],
    stop: Sequence[str],
    skip_special_tokens: bool,
    request: Request | None,
) -> AsyncIterator[ChoiceDelta]:
    """Run all children concurrently; yield their deltas as they come.

    Ends after every child yielded its final delta. If `request`'s client
    disconnects, every child is aborted and ClientDisconnected is raised; past
    `ctx.request_timeout` they are aborted and RequestError (504) is raised. Closing
    this generator early aborts every unfinished child as well.
    """
    queue: asyncio.Queue[ChoiceDelta | None] = asyncio.Queue()
    tasks = [
        asyncio.create_task(_run_child(ctx, c, stop, skip_special_tokens, queue), name=c.rid)
        for c in children
    ]
    watcher = (
        asyncio.create_task(_watch_disconnect(request, tasks, queue))
        if request is not None
        else None
    )
    remaining = len(tasks)
    loop = asyncio.get_running_loop()
    deadline = None if ctx.request_timeout is None else loop.time() + ctx.request_timeout
    try:
        while remaining:
            if deadline is None:
                delta = await queue.get()
            else:
                try:
                    delta = await asyncio.wait_for(queue.get(), max(0.0, deadline - loop.time()))
                except asyncio.TimeoutError:  # NOTE: the finally below aborts the children
                    msg = f"the request exceeded --request-timeout {ctx.request_timeout:g} s"
                    raise RequestError(msg, HTTPStatus.GATEWAY_TIMEOUT) from None
            if delta is None:
                raise ClientDisconnected()
            if delta.finished:
                remaining -= 1
            yield delta
    finally:
        # NOTE: cancel, never await: this may run in a cancelled scope. A
        # cancelled child closes its engine generator, which sends the abort.
        for task in tasks:
            task.cancel()
        if watcher is not None:
            watcher.cancel()


async def _run_child(
    ctx: ServingContext,
    child: ChildSpec,
    stop: Sequence[str],
    skip_special_tokens: bool,
    queue: asyncio.Queue[ChoiceDelta | None],
) -> None:
    decoder = SequenceDecoder(
        ctx.tokenizer,
        child.index,
        child.prompt_ids,
        stop,
        skip_special_tokens,
        child.sampling.min_tokens,
    )
    timer = ctx.metrics.start() if ctx.metrics is not None else None
    reason = "abort"  # NOTE: unless it finishes: a client that left, a cancelled task
    if ctx.log_requests:
        logger.info("request %s: %d prompt tokens, %s", child.rid, len(child.prompt_ids),
                    child.sampling)  # fmt: skip
    try:
        observe = timer.output if timer is not None else None
        outputs = ctx.engine.generate(child.rid, child.prompt_ids, child.sampling, observe)
        async with aclosing(outputs):
            async for out in outputs:
                delta = decoder.feed(out)
                queue.put_nowait(delta)
                if delta.finished:
                    reason = delta.finish_reason or "stop"
                    return  # leaving `aclosing` aborts a request stopped by a stop string
        reason = "error"
        queue.put_nowait(decoder.fail("the engine stream ended without a finish reason"))
    except EngineDeadError as exc:
        reason = "error"
        queue.put_nowait(decoder.fail(str(exc)))
    except Exception as exc:
        reason = "error"
        logger.exception("choice %s failed", child.rid)
        queue.put_nowait(decoder.fail(f"internal error: {exc!r}"))
    finally:
        if timer is not None:
            timer.finish(reason)
            if ctx.log_requests:
                logger.info("request %s: %s", child.rid, timer.summary(reason))


async def _watch_disconnect(
    request: Request, tasks: list[asyncio.Task[None]], queue: asyncio.Queue[ChoiceDelta | None]
) -> None:
    # NOTE: the body was read before the handler ran, so the next ASGI message
    # is the disconnect; waiting on it costs nothing, unlike polling.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for task in tasks:
                task.cancel()
            queue.put_nowait(None)
            return
