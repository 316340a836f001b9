"""Start the server: frontend in this process, the scheduler and one worker per rank
as children.

Shutdown is ordered here: SIGINT/SIGTERM (to this process or its whole group)
stop uvicorn, which lets requests in flight finish; then the children are told
to stop (the shared `stopping` flag, then SIGTERM) and joined, and we exit 0.
Children ignore the group's signals (utils.ChildStop), so an ordered stop is
never seen as a death. If a child dies while serving, the watchdog logs why,
stops the server, and we exit non-zero.

Threads: the frontend and the scheduler run torch on one thread; the worker on
`--cpu-threads`. The children are spawned with OMP_WAIT_POLICY=PASSIVE and
KMP_BLOCKTIME=0 (unless set by the user), so their idle OpenMP threads sleep
instead of spinning on cores that other processes need.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import logging
import multiprocessing as mp
import shutil
import signal
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.frontend.engine_client import EngineClient
from gyrfalcon.ipc.contract import RankLayout
from gyrfalcon.ipc.sockets import IpcPaths
from gyrfalcon.utils import (
    CHILD_START_BLOCKED,
    configure_logging,
    free_port,
    set_child_openmp_env,
    set_torch_threads,
)

if TYPE_CHECKING:
    import uvicorn

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
    """Stop the server when a child dies. It runs only while uvicorn serves; the
    children are stopped after it is cancelled, so an ordered stop is not reported."""
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


def _sigterm_while_starting(*_: object) -> None:
    logger.info("SIGTERM while starting: stopping")
    raise SystemExit(0)


def _on_sigterm(server: uvicorn.Server) -> None:
    """SIGTERM outside uvicorn's own handling (before it serves, or the signal it
    re-raises once it has shut down): stop serving, never raise, so the cleanup in
    `serve` runs and a requested shutdown exits 0."""
    if not server.should_exit:
        logger.info("SIGTERM: shutting down")
        server.should_exit = True


def serve(args: ServerArgs) -> int:
    """Run the server until it is stopped; returns the process exit code."""
    configure_logging(args.log_level)
    signal.signal(signal.SIGTERM, _sigterm_while_starting)  # no child to stop yet
    from transformers import AutoTokenizer

    from gyrfalcon.frontend.server import create_app, make_uvicorn_server
    from gyrfalcon.loader.resolve import default_model_name, resolve_model
    from gyrfalcon.scheduler.process import run_scheduler
    from gyrfalcon.worker.process import run_worker

    model_dir = resolve_model(args.model, args.cache_dir)
    model_cfg = ModelConfig.from_dir(model_dir)
    args = args.resolved(model_cfg.head_dim)
    # NOTE: the frontend does no tensor math worth threads. Set after a GGUF conversion
    # (which may use them) and after torch is imported (else the children inherit it).
    set_torch_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or model_dir)
    name = args.served_model_name or default_model_name(args.model)
    logger.info(
        "serving %s (%s, %s attention) from %s on %s",
        name, args.dtype, args.attention_backend, model_dir, args.device,
    )  # fmt: skip

    # NOTE: one worker process per rank; all below (sockets, processes, readiness,
    # results) is written for layout.world_size
    layout = RankLayout(dp_size=args.dp_size, tp_size=args.tp_size)
    if args.joins_process_groups() and args.dist_init_addr is None:
        args = dataclasses.replace(args, dist_init_addr=f"tcp://127.0.0.1:{free_port()}")
    paths, ipc_root = IpcPaths.create(layout.world_size)
    engine = EngineClient(paths)
    app = create_app(engine, tokenizer, name)
    server = make_uvicorn_server(app, args.host, args.port, args.log_level)
    ctx = mp.get_context("spawn")
    # NOTE: no lock: the children read it inside a signal handler.
    stopping = ctx.RawValue(ctypes.c_bool, False)
    scheduler_args = (args, paths, model_cfg, layout, stopping)
    procs: list[BaseProcess] = [
        ctx.Process(target=run_scheduler, args=scheduler_args, name="scheduler")
    ]
    for rank in range(layout.world_size):
        worker_args = (args, paths, model_dir, model_cfg, rank, layout, stopping)
        procs.append(ctx.Process(target=run_worker, args=worker_args, name=f"worker{rank}"))
    state = {"code": 0}

    async def main() -> None:
        await engine.start()
        watchdog = asyncio.create_task(_watchdog(procs, server, engine, state))
        try:
            await server.serve()
        finally:
            watchdog.cancel()
            engine.close()

    signal.signal(signal.SIGTERM, lambda *_: _on_sigterm(server))
    set_child_openmp_env()
    # NOTE: the children inherit this mask (it survives exec) and unblock the signals once
    # their handlers are in (setup_child): a group signal that comes while a child still
    # imports torch waits for them instead of killing it.
    signal.pthread_sigmask(signal.SIG_BLOCK, CHILD_START_BLOCKED)
    try:
        for p in procs:
            p.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, CHILD_START_BLOCKED)
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stopping.value = True  # NOTE: before the SIGTERMs: the children act on them only then
        _stop_children(procs)
        shutil.rmtree(ipc_root, ignore_errors=True)
    logger.info("server stopped")
    return state["code"]
