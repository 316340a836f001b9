"""The FastAPI app: OpenAI-compatible routes, OpenAI-shaped errors, uvicorn glue.

`create_app` only wires objects it is given; the launcher owns the engine
client (starts it before serving, closes it after) and the tokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import socket
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import msgspec
import uvicorn
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

import gyrfalcon
from gyrfalcon.frontend.auth import ApiKeyAuth
from gyrfalcon.frontend.body_limit import DEFAULT_MAX_BODY_BYTES, BodyLimit
from gyrfalcon.frontend.engine_client import EngineClient, EngineDeadError
from gyrfalcon.frontend.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gyrfalcon.frontend.metrics import ServingMetrics
from gyrfalcon.frontend.protocol import ChatCompletionRequest, CompletionRequest, ParamError
from gyrfalcon.frontend.protocol_responses import ModelCard, ModelList, now
from gyrfalcon.frontend.protocol_tokenize import UNION_TAGS, DetokenizeRequest, TokenizeRequest
from gyrfalcon.frontend.serving_chat import create_chat_completion
from gyrfalcon.frontend.serving_common import (
    ClientDisconnected,
    RequestError,
    ServingContext,
    error_body,
)
from gyrfalcon.frontend.serving_completions import create_completion
from gyrfalcon.frontend.serving_tokenize import create_detokenize, create_tokenize
from gyrfalcon.frontend.tool_parsers import get_tool_parser
from gyrfalcon.utils import SHUTDOWN_GRACE_S

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

STATS_TIMEOUT_S = 5.0  # /server_info waits this long for the scheduler's StatsReply
# Status of a response to a client that already left (nginx's convention).
CLIENT_CLOSED_REQUEST = 499
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
# NOTE: the C implementations where installed (both are dependencies on Linux): every
# streamed token passes the event loop and the HTTP writer on one core, which a DP
# server's token rate nearly fills (benchmarks/NOTES.md, stop 52)
HTTP_IMPL = "httptools" if importlib.util.find_spec("httptools") else "h11"


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where it is installed, else None (asyncio's own)."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run the frontend's `main` to its end on `event_loop_factory`'s loop (as
    `asyncio.run` does: Ctrl-C cancels `main`)."""
    factory = event_loop_factory()
    if factory is None or not hasattr(asyncio, "Runner"):  # NOTE: Runner is 3.11+
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=factory) as runner:
        runner.run(main)


def event_loop_name() -> str:
    """The running loop's implementation: "uvloop" or "asyncio"."""
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def json_response(
    payload: BaseModel | dict[str, Any],
    status: int = HTTPStatus.OK,
    headers: dict[str, str] | None = None,
) -> Response:
    body = (
        payload.model_dump_json()
        if isinstance(payload, BaseModel)
        else msgspec.json.encode(payload)
    )
    return Response(
        content=body, status_code=int(status), media_type="application/json", headers=headers
    )


def error_response(status: HTTPStatus, message: str, param: str | None = None) -> Response:
    return json_response(error_body(status, message, param), status)


def _respond(result: BaseModel | AsyncIterator[str]) -> Response:
    if isinstance(result, BaseModel):
        return json_response(result)
    return StreamingResponse(result, media_type="text/event-stream", headers=SSE_HEADERS)


def _validation_error(exc: RequestValidationError) -> Response:
    """FastAPI's 422 becomes OpenAI's 400, naming the offending field."""
    errors = exc.errors()
    if not errors:
        return error_response(HTTPStatus.BAD_REQUEST, "invalid request")
    first = errors[0]
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, ParamError):
        return error_response(HTTPStatus.BAD_REQUEST, cause.message, cause.param)
    if first.get("type") == "json_invalid":
        return error_response(HTTPStatus.BAD_REQUEST, f"malformed JSON body: {first.get('msg')}")
    param = _format_loc(_common_loc(errors)) or None
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return error_response(HTTPStatus.BAD_REQUEST, message, param)


def _common_loc(errors: list[Any]) -> list[Any]:
    """The location of the first error's field: the common prefix of the errors
    under the same top-level field (a union reports one error per member, with
    the member's type name appended to the location; a tagged union, its tag)."""
    locs = [[p for p in e.get("loc", ()) if p != "body" and p not in UNION_TAGS] for e in errors]
    head = locs[0]
    same_field = [loc for loc in locs if loc[:1] == head[:1]]
    common: list[Any] = []
    for parts in zip(*same_field):
        if any(p != parts[0] for p in parts):
            break
        common.append(parts[0])
    return common


def _format_loc(loc: list[Any]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role'."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(_: Request, exc: RequestValidationError) -> Response:
        return _validation_error(exc)

    @app.exception_handler(RequestError)
    async def _on_request_error(_: Request, exc: RequestError) -> Response:
        return json_response(exc.body(), exc.status, exc.headers)

    @app.exception_handler(ClientDisconnected)
    async def _on_disconnect(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> Response:
        return error_response(HTTPStatus(exc.status_code), str(exc.detail))

    @app.exception_handler(Exception)
    async def _on_bug(_: Request, exc: Exception) -> Response:
        logger.exception("internal error", exc_info=exc)
        return error_response(HTTPStatus.INTERNAL_SERVER_ERROR, f"internal error: {exc!r}")


def create_app(
    engine: EngineClient,
    tokenizer: PreTrainedTokenizerBase,
    model_name: str,
    max_model_len: int | None = None,
    api_key: str | None = None,
    log_requests: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    request_timeout: float | None = None,
    tool_call_parser: str | None = None,
) -> FastAPI:
    """Build the app. `engine` must be started before the first request. With an
    `api_key`, every route but /health, /version and /metrics requires it
    (frontend/auth.py). `tool_call_parser` names a `tool_parsers.TOOL_PARSERS` entry
    (ValueError for another name)."""
    if tool_call_parser is not None:
        get_tool_parser(tool_call_parser)  # NOTE: a misspelt name fails at start-up
    metrics = ServingMetrics(model_name)
    ctx = ServingContext(
        engine, tokenizer, model_name, max_model_len, metrics, log_requests, request_timeout,
        tool_call_parser,
    )  # fmt: skip
    app = FastAPI(title="gyrfalcon", version=gyrfalcon.__version__)
    # NOTE: the last added runs first: a client without the key never gets to send a
    # body the limit reads
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes)
    if api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    app.state.serving = ctx
    _install_error_handlers(app)
    created = now()

    @app.get("/health")
    async def health() -> Response:
        if engine.dead is not None:
            return error_response(HTTPStatus.SERVICE_UNAVAILABLE, f"engine is dead: {engine.dead}")
        if not engine.ready.is_set():
            return error_response(HTTPStatus.SERVICE_UNAVAILABLE, "engine is not ready yet")
        return json_response({})

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": gyrfalcon.__version__})

    @app.get("/v1/models")
    async def models() -> Response:
        ctx.check_engine()
        card = ModelCard(id=model_name, created=created, max_model_len=ctx.max_model_len)
        return json_response(ModelList(data=[card]))

    @app.get("/v1/models/{model:path}")  # `path`: model ids may hold a `/`
    async def retrieve_model(model: str) -> Response:
        ctx.check_model(model)
        ctx.check_engine()
        return json_response(
            ModelCard(id=model_name, created=created, max_model_len=ctx.max_model_len)
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return _respond(await create_chat_completion(ctx, body, request))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return _respond(await create_completion(ctx, body, request))

    @app.post("/tokenize")
    @app.post("/v1/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        return json_response(create_tokenize(ctx, body))

    @app.post("/detokenize")
    @app.post("/v1/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        return json_response(create_detokenize(ctx, body))

    @app.get("/metrics")
    async def metrics() -> Response:
        """Prometheus text (frontend/metrics.py); the engine's part is left out when
        the scheduler does not answer in time."""
        assert ctx.metrics is not None
        try:
            stats = await engine.stats(timeout=STATS_TIMEOUT_S)
        except (TimeoutError, EngineDeadError):
            stats = None
        return Response(ctx.metrics.render(stats), media_type=METRICS_CONTENT_TYPE)

    @app.get("/server_info")
    async def server_info() -> Response:
        try:
            reply = await engine.stats(timeout=STATS_TIMEOUT_S)
        except (TimeoutError, EngineDeadError) as exc:
            return error_response(
                HTTPStatus.SERVICE_UNAVAILABLE, f"engine stats unavailable: {exc!r}"
            )
        info = msgspec.structs.asdict(reply)
        info.update(
            model=model_name, max_model_len=ctx.max_model_len, num_in_flight=engine.num_in_flight,
            event_loop=event_loop_name(), http=HTTP_IMPL, api_server=engine.api_server,
        )  # fmt: skip
        return json_response(info)

    return app


# NOTE: idle keep-alive connections live longer here than in the clients' pools (httpx,
# and so the openai client, drop theirs after 5 s, uvicorn's own default): with both at
# 5 s, a client can send its next request on a connection the server is closing at
# that moment and get a ReadError before any response (a ReadError like that, seen once
# on a loaded CI machine with 256 streams at once, fits this race; not proven its cause)
KEEP_ALIVE_S = 30


class ChildServer(uvicorn.Server):
    """A uvicorn server that leaves the signals alone: in an API server process other
    than the launcher's, the launcher orders the shutdown (utils.ChildStop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def make_uvicorn_server(
    app: FastAPI,
    host: str,
    port: int,
    log_level: str,
    shutdown_timeout: float | None = None,
    capture_signals: bool = True,
) -> uvicorn.Server:
    """A uvicorn server for `app`; the launcher awaits `server.serve()` in its loop.
    shutdown_timeout: see `drain_on_shutdown`; uvicorn itself cancels what is left
    SHUTDOWN_GRACE_S later (None: it waits for every connection). Without
    `capture_signals`, SIGINT and SIGTERM do not stop it (`ChildServer`)."""
    grace = None if shutdown_timeout is None else shutdown_timeout + SHUTDOWN_GRACE_S
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level.lower(), access_log=False,
        timeout_graceful_shutdown=grace, timeout_keep_alive=KEEP_ALIVE_S, http=HTTP_IMPL,
    )  # fmt: skip
    return uvicorn.Server(config) if capture_signals else ChildServer(config)


def shared_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) with SO_REUSEPORT, for `server.serve(sockets=
    [sock])`: every API server binds its own and the kernel spreads new connections
    over those that listen (uvicorn listens once it starts).

    NOTE: SO_REUSEPORT lets another process of this user bind the port too; a port
    that a socket without it holds still fails here with "address in use"."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


async def drain_on_shutdown(
    server: uvicorn.Server, engine: EngineClient, timeout_s: float, poll_s: float = 0.05
) -> None:
    """Once uvicorn is stopping (SIGTERM, SIGINT: it takes no new connections and waits
    for the open ones), give the requests in flight `timeout_s` to finish, then end the
    rest with an error: a non-streamed one gets a 503, a stream an error event and its
    end, so every client hears why instead of a dropped connection."""
    while not server.should_exit:
        await asyncio.sleep(poll_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while engine.num_in_flight and loop.time() < deadline:
        await asyncio.sleep(poll_s)
    if engine.num_in_flight:
        n = engine.num_in_flight
        logger.warning("%d requests still running after --shutdown-timeout: ending them", n)
        engine.mark_dead(f"the server is shutting down (--shutdown-timeout {timeout_s:g} s)")
