"""Test doubles for the frontend: a scripted fake scheduler and a live server.

The fake scheduler binds the scheduler's side of the frontend sockets (as the
real one does) and answers each GenerateRequest from a script, honouring the
engine contract: new token ids per output, logprobs when asked, prompt
logprobs once, a final output with finish_reason, the stop token as the last
id of a "stop" output, and a final "abort" output after an AbortRequest.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import zmq
import zmq.asyncio
from server_util import sse_events  # noqa: F401  (re-exported to the frontend tests)

from gyrfalcon.frontend.body_limit import DEFAULT_MAX_BODY_BYTES
from gyrfalcon.frontend.engine_client import EngineClient
from gyrfalcon.frontend.server import create_app, make_uvicorn_server
from gyrfalcon.ipc.messages import (
    AbortRequest,
    BatchOutput,
    EngineError,
    EngineReady,
    FrontendToScheduler,
    GenerateRequest,
    PositionLogprobs,
    RequestOutput,
    StatsReply,
    StatsRequest,
    TokenLogprob,
)
from gyrfalcon.ipc.sockets import AsyncChannel, IpcPaths

MODEL_NAME = "smollm2-test"
MAX_MODEL_LEN = 256
NUM_KV_PAGES = 64
PAGE_SIZE = 16
EOS_ID = 2  # <|im_end|>
SAMPLED_LOGPROB = -0.5
PROMPT_LOGPROB = -1.25
TEST_TIMEOUT_S = 30.0


@dataclass
class Script:
    """How the fake engine answers one request."""

    token_ids: list[int]
    finish: str = "stop"  # when the script runs out: "stop" appends EOS_ID
    chunk: int = 1  # tokens per output
    delay_s: float = 0.0  # pause before each output
    error: str | None = None  # finish with "error" and this text instead
    error_status: int = 0  # RequestOutput.error_status of that error


@dataclass
class FakeScheduler:
    paths: IpcPaths
    script_for: Callable[[GenerateRequest], Script]
    send_ready: bool = True
    requests: list[GenerateRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    active: dict[str, asyncio.Task[None]] = field(default_factory=dict)

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._pull = AsyncChannel(
            self._ctx,
            zmq.PULL,
            self.paths.frontend_to_scheduler,
            bind=True,
            decode_type=FrontendToScheduler,
        )
        self._push = AsyncChannel(self._ctx, zmq.PUSH, self.paths.scheduler_to_frontend, bind=True)
        self._loop = asyncio.create_task(self._serve())
        if self.send_ready:
            # NOTE: a PUSH send waits for a connected peer: not awaited here.
            self._ready_sent = asyncio.create_task(self.ready())

    async def ready(self) -> None:
        await self._push.send(EngineReady(MAX_MODEL_LEN, NUM_KV_PAGES, PAGE_SIZE))

    async def die(self, message: str) -> None:
        await self._push.send(EngineError(message))

    def close(self) -> None:
        self._loop.cancel()
        for task in self.active.values():
            task.cancel()
        self._ctx.destroy(linger=0)

    async def _serve(self) -> None:
        while True:
            msg = await self._pull.recv()
            if isinstance(msg, GenerateRequest):
                self.requests.append(msg)
                self.active[msg.rid] = asyncio.create_task(self._run(msg))
            elif isinstance(msg, AbortRequest):
                self.aborted.append(msg.rid)
                task = self.active.pop(msg.rid, None)
                if task is not None:
                    task.cancel()
                    await self._emit(RequestOutput(msg.rid, [], finish_reason="abort"))
            elif isinstance(msg, StatsRequest):
                await self._push.send(
                    StatsReply(
                        nonce=msg.nonce,
                        num_total_pages=NUM_KV_PAGES,
                        num_free_pages=NUM_KV_PAGES - len(self.active),
                        num_running=len(self.active),
                        num_waiting=0,
                        integrity_ok=True,
                    )
                )

    async def _emit(self, out: RequestOutput) -> None:
        await self._push.send(BatchOutput([out]))

    async def _run(self, req: GenerateRequest) -> None:
        script = self.script_for(req)
        sp = req.sampling
        ids = list(script.token_ids)
        budget = sp.max_tokens
        stop_at = next((i for i, t in enumerate(ids[:budget]) if t in sp.stop_token_ids), None)
        if stop_at is not None:
            ids, finish = ids[: stop_at + 1], "stop"
        elif len(ids) >= budget:
            ids, finish = ids[:budget], "length"
        elif script.finish == "stop":
            ids, finish = ids + [EOS_ID], "stop"
        else:
            finish = script.finish
        done = 0
        first = True
        while True:
            if script.delay_s:
                await asyncio.sleep(script.delay_s)
            new = ids[done : done + script.chunk]
            done += len(new)
            last = done >= len(ids)
            out = RequestOutput(
                req.rid, new, num_prompt_tokens=len(req.prompt_ids), num_output_tokens=done
            )
            if sp.logprobs is not None:
                out.logprobs = [_position(t, SAMPLED_LOGPROB, sp.logprobs) for t in new]
            if first and sp.prompt_logprobs is not None:
                out.prompt_logprobs = [None] + [
                    _position(t, PROMPT_LOGPROB, sp.prompt_logprobs) for t in req.prompt_ids[1:]
                ]
            first = False
            if last:
                out.finish_reason = "error" if script.error else finish
                out.error = script.error
                out.error_status = script.error_status
                self.active.pop(req.rid, None)
            await self._emit(out)
            if last:
                return


def _position(token_id: int, logprob: float, k: int) -> PositionLogprobs:
    top = [TokenLogprob(token_id, logprob)] + [
        TokenLogprob(token_id + j, logprob - j) for j in range(1, k)
    ]
    return PositionLogprobs(token_id, logprob, top[:k])


@dataclass
class LiveServer:
    url: str
    scheduler: FakeScheduler
    engine: EngineClient
    app: Any  # the FastAPI app
    server: Any  # its uvicorn server


@asynccontextmanager
async def live_server(
    tokenizer,
    script_for: Callable[[GenerateRequest], Script],
    send_ready: bool = True,
    model_name: str = MODEL_NAME,
    api_key: str | None = None,
    log_requests: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    request_timeout: float | None = None,
    tool_call_parser: str | None = None,
) -> AsyncIterator[LiveServer]:
    """Fake scheduler + EngineClient + uvicorn on an ephemeral port, in this loop."""
    paths, root = IpcPaths.create()
    scheduler = FakeScheduler(paths, script_for, send_ready=send_ready)
    await scheduler.start()
    engine = EngineClient(paths)
    await engine.start()
    if send_ready:
        await asyncio.wait_for(engine.ready.wait(), TEST_TIMEOUT_S)
    app = create_app(
        engine, tokenizer, model_name, MAX_MODEL_LEN, api_key, log_requests, max_body_bytes,
        request_timeout, tool_call_parser,
    )  # fmt: skip
    server = make_uvicorn_server(app, "127.0.0.1", 0, "warning")
    serving = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", scheduler, engine, app, server)
    finally:
        server.should_exit = True
        await serving
        engine.close()
        scheduler.close()
        shutil.rmtree(root, ignore_errors=True)


def run(coro_fn: Callable[[], object]) -> None:
    """Run an async test body with a global timeout."""
    asyncio.run(asyncio.wait_for(coro_fn(), TEST_TIMEOUT_S))  # type: ignore[arg-type]


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll until predicate() holds; fail the test after timeout_s."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------- HTTP helpers

REPLY = "Hello world, this is 😀 a test."
SLOW_S = 0.02
USER = [{"role": "user", "content": "hi"}]
LONG_REPLY_TOKENS = list(range(300, 400))


def slow_script(req: GenerateRequest) -> Script:
    """A long, slow answer: time for the client to leave mid-generation."""
    return Script(LONG_REPLY_TOKENS, delay_s=SLOW_S)


def rejecting_script(req: GenerateRequest) -> Script:
    """The engine refuses the request with a per-request error."""
    return Script([], finish="error", error="too big")


def replying(tokenizer, text: str = REPLY, **kw: Any) -> Callable[[GenerateRequest], Script]:
    """A script answering every request with `text` (Script options in kw)."""
    ids = tokenizer.encode(text)
    return lambda req: Script(ids, **kw)


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The prompt ids the server must send for `messages`."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


async def post(url: str, path: str, body: dict[str, Any] | str) -> httpx.Response:
    """POST JSON (a dict) or raw text sent as JSON (to test malformed bodies)."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        if isinstance(body, str):
            return await client.post(
                path, content=body, headers={"content-type": "application/json"}
            )
        return await client.post(path, json=body)


# ---------------------------------------------------------------- a tokenizer unlike SmolLM2's

WORDS = ["<unk>", "<s>", "</s>", "system", "user", "assistant", "hi", "there", "sure", "here"]
WORD_BOS_ID = 1


def word_tokenizer():
    """A tiny word-level tokenizer that, unlike SmolLM2's, adds a BOS when asked
    for special tokens; its chat template writes the BOS too (as Llama's does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", WORD_BOS_ID)]
    )
    backend.decoder = decoders.WordPiece()  # joins words with spaces
    template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }} {{ m['content'] }} </s> "
        "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        chat_template=template,
    )
