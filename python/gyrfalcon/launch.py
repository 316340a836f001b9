"""Start the server: frontend in this process, scheduler and worker as children.

Shutdown: SIGINT/SIGTERM stop uvicorn, then the children are terminated.
If a child dies, the watchdog logs why, stops the server, and we exit non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import shutil
import signal
from multiprocessing.process import BaseProcess

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.frontend.engine_client import EngineClient
from gyrfalcon.ipc.sockets import IpcPaths
from gyrfalcon.utils import configure_logging

logger = logging.getLogger("gyrfalcon")

WATCHDOG_PERIOD_S = 0.5
CHILD_JOIN_TIMEOUT_S = 5.0


def _stop_children(procs: list[BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(CHILD_JOIN_TIMEOUT_S)
        if p.is_alive():
            logger.warning("%s did not stop; killing it", p.name)
            p.kill()
            p.join()


async def _watchdog(
    procs: list[BaseProcess], server: object, engine: EngineClient, state: dict[str, int]
) -> None:
    while True:
        await asyncio.sleep(WATCHDOG_PERIOD_S)
        for p in procs:
            if not p.is_alive():
                msg = f"{p.name} exited unexpectedly (exit code {p.exitcode})"
                logger.error("%s; shutting down", msg)
                engine.mark_dead(msg)
                state["code"] = 1
                server.should_exit = True  # type: ignore[attr-defined]
                return


def serve(args: ServerArgs) -> int:
    """Run the server until it is stopped; returns the process exit code."""
    from transformers import AutoTokenizer

    from gyrfalcon.frontend.server import create_app, make_uvicorn_server
    from gyrfalcon.loader.resolve import default_model_name, resolve_model
    from gyrfalcon.scheduler.process import run_scheduler
    from gyrfalcon.worker.process import run_worker

    configure_logging(args.log_level)
    model_dir = resolve_model(args.model, args.cache_dir)
    model_cfg = ModelConfig.from_dir(model_dir)
    args = args.resolved(model_cfg.head_dim)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_dir)
    name = args.served_model_name or default_model_name(args.model)
    logger.info(
        "serving %s (%s, %s attention) from %s on %s",
        name, args.dtype, args.attention_backend, model_dir, args.device,
    )  # fmt: skip

    paths, ipc_root = IpcPaths.create()
    ctx = mp.get_context("spawn")
    procs: list[BaseProcess] = [
        ctx.Process(target=run_scheduler, args=(args, paths, model_cfg), name="scheduler"),
        ctx.Process(target=run_worker, args=(args, paths, model_dir, model_cfg, 0), name="worker0"),
    ]
    for p in procs:
        p.start()
    state = {"code": 0}
    # NOTE: uvicorn re-raises the signal that stopped it once it has shut down;
    # a Python-level handler makes that a no-op so the cleanup below still runs
    # and a requested shutdown exits 0.
    signal.signal(signal.SIGTERM, lambda *_: logger.info("SIGTERM: shutting down"))
    try:
        engine = EngineClient(paths)
        app = create_app(engine, tokenizer, name)
        server = make_uvicorn_server(app, args.host, args.port, args.log_level)

        async def main() -> None:
            await engine.start()
            watchdog = asyncio.create_task(_watchdog(procs, server, engine, state))
            try:
                await server.serve()
            finally:
                watchdog.cancel()
                engine.close()

        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _stop_children(procs)
        shutil.rmtree(ipc_root, ignore_errors=True)
    logger.info("server stopped")
    return state["code"]
