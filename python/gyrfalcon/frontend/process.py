"""An API server process (--api-server-count > 1): one more HTTP frontend on the
launcher's port, with its own tokenizer, app and engine client.

The launcher's process is API server 0 (launch.py); it spawns 1 .. N-1 with
`run_api_server`. Each binds the port with SO_REUSEPORT (`shared_port_socket`) once
the engine is ready, so it never answers "not ready": until then the connections go
to API server 0, which does. The launcher orders its stop (utils.ChildStop: a SIGTERM
counts once the launcher's `stopping` flag of the API servers is set): it then drains
its requests as API server 0 does (`drain_on_shutdown`) and exits 0.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from typing import TYPE_CHECKING

from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.frontend.engine_client import EngineClient
from gyrfalcon.gc_heap import GcPauses, freeze_startup_heap
from gyrfalcon.ipc.sockets import IpcPaths
from gyrfalcon.utils import ChildStop, set_torch_threads, setup_child

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

STOP_POLL_S = 0.05  # how often an API server (and the launcher) looks for its stop


def build_app(
    args: ServerArgs, engine: EngineClient, tokenizer: PreTrainedTokenizerBase, name: str
) -> FastAPI:
    """The app of one API server, from the server's flags."""
    from gyrfalcon.frontend.server import create_app

    return create_app(
        engine, tokenizer, name, api_key=args.api_key, log_requests=args.log_requests,
        max_body_bytes=args.max_request_body_bytes, request_timeout=args.request_timeout,
        tool_call_parser=args.tool_call_parser,
    )  # fmt: skip


async def freeze_when_ready(engine: EngineClient, index: int) -> None:
    """A task of API server `index`: freeze its start-up heap once the engine is ready
    (gc_heap.py), then count its collections until cancelled at shutdown and log them."""
    await engine.ready.wait()
    freeze_startup_heap()
    pauses = GcPauses().install()
    try:
        await asyncio.Event().wait()
    finally:
        logger.info("API server %d: %s", index, pauses.summary())


def api_server_name(index: int) -> str:
    """The process name of API server `index` (1 .. N-1; 0 is the launcher's)."""
    return f"api-server{index}"


def run_api_server(
    args: ServerArgs,
    paths: IpcPaths,
    index: int,
    tokenizer_dir: str,
    model_name: str,
    stopping: ctypes.c_bool,
) -> None:
    """Entry point of API server `index` (>= 1)."""
    stop = setup_child(api_server_name(index), args.log_level, stopping)
    from transformers import AutoTokenizer

    from gyrfalcon.frontend.server import make_uvicorn_server, run_event_loop

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    set_torch_threads(1)  # NOTE: as API server 0: no tensor math worth threads
    engine = EngineClient(paths, index)
    app = build_app(args, engine, tokenizer, model_name)
    server = make_uvicorn_server(
        app, args.host, args.port, args.log_level, args.shutdown_timeout, capture_signals=False
    )
    stop.serving()  # NOTE: from here a stop only sets `stop.requested` (_stop_when_asked)
    run_event_loop(_serve(args, index, engine, server, stop))
    logger.info("API server %d stopped", index)


async def _serve(
    args: ServerArgs, index: int, engine: EngineClient, server: uvicorn.Server, stop: ChildStop
) -> None:
    from gyrfalcon.frontend.server import drain_on_shutdown, shared_port_socket

    await engine.start()
    watch = asyncio.create_task(_stop_when_asked(server, engine, stop))
    freeze = asyncio.create_task(freeze_when_ready(engine, index))
    drain = None
    try:
        while not (engine.ready.is_set() or server.should_exit):
            await asyncio.sleep(STOP_POLL_S)
        if server.should_exit:
            return
        sock = shared_port_socket(args.host, args.port)
        logger.info("API server %d: HTTP on %s:%d (SO_REUSEPORT)", index, args.host, args.port)
        drain = asyncio.create_task(drain_on_shutdown(server, engine, args.shutdown_timeout))
        await server.serve(sockets=[sock])
    finally:
        for task in (watch, freeze, drain):
            if task is not None:
                task.cancel()
        engine.close()


async def _stop_when_asked(server: uvicorn.Server, engine: EngineClient, stop: ChildStop) -> None:
    """Stop serving once the launcher asks (or is gone: then the engine is too)."""
    while not (stop.requested or stop.parent_gone()):
        await asyncio.sleep(STOP_POLL_S)
    if stop.parent_gone():
        engine.mark_dead("the launcher is gone")
    server.should_exit = True
