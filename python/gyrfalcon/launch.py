"""Start the server: frontend in this process, the scheduler and one worker per rank
as children, spawned before this process imports the frontend (torch, transformers,
xgrammar), so their start overlaps those imports and the tokenizer's load.

Shutdown is ordered here: SIGINT/SIGTERM (to this process or its whole group)
stop uvicorn, which lets requests in flight finish; then the children are told
to stop (the shared `stopping` flag, then SIGTERM) and joined, and we exit 0.
Children ignore the group's signals (utils.ChildStop), so an ordered stop is
never seen as a death. If a child dies while serving, the watchdog logs why,
stops the server, and we exit non-zero.

Several nodes (--nnodes > 1): this process is the head (node 0) and runs only its
own ranks; every other node runs `node.py`, whose ranks reach the scheduler over
TCP (ipc/sockets.NodePorts). The watchdog also stops the server when another node
fails or falls silent (node_link.NodeWatch), and the others are told when the head
stops.

Several API servers (--api-server-count N > 1): this process is API server 0 and
spawns 1 .. N-1 (frontend/process.py), all on the same port (SO_REUSEPORT). They are
children like the others: one that dies stops the server; a shutdown stops them
first, together with this one's own drain (they finish their requests meanwhile), and
the scheduler and the workers only after. Their request metrics meet in a private
directory (prometheus-client's multiprocess mode, frontend/metrics.py).

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
import os
import shutil
import signal
import sys
import tempfile
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

from gyrfalcon.config.nodes import parse_init_addr
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.frontend.engine_client import EngineClient
from gyrfalcon.frontend.process import (
    STOP_POLL_S,
    api_server_name,
    build_app,
    freeze_when_ready,
    run_api_server,
)
from gyrfalcon.ipc.contract import RankLayout
from gyrfalcon.ipc.sockets import IpcPaths, NodePorts
from gyrfalcon.node_link import NodeWatch
from gyrfalcon.utils import (
    CHILD_JOIN_TIMEOUT_S,
    MULTIPROC_DIR_ENV,
    SHUTDOWN_GRACE_S,
    configure_logging,
    dead_child,
    free_port,
    set_torch_threads,
    start_children,
    stop_children,
)

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger("gyrfalcon")

WATCHDOG_PERIOD_S = 0.5


async def _watchdog(
    procs: list[BaseProcess],
    api_servers: list[BaseProcess],
    nodes: NodeWatch | None,
    server: uvicorn.Server,
    engine: EngineClient,
    state: dict,
) -> None:
    """Stop the server when a child dies, or another node (`nodes`). It runs only while
    uvicorn serves; the children are stopped after it is cancelled, so an ordered stop
    is not reported; the API servers, stopped while it still runs, count only until
    this server stops."""
    while True:
        await asyncio.sleep(WATCHDOG_PERIOD_S)
        dead = dead_child(procs if server.should_exit else [*procs, *api_servers])
        msg = dead and f"{dead.name} exited unexpectedly (exit code {dead.exitcode})"
        msg = msg or (nodes.check() if nodes is not None else None)
        if msg is not None:
            logger.error("%s; shutting down", msg)
            engine.mark_dead(msg)
            state["code"], state["error"] = 1, msg
            server.should_exit = True  # type: ignore[attr-defined]
            return


async def _stop_api_servers_with(
    server: uvicorn.Server, api_servers: list[BaseProcess], api_stopping: ctypes.c_bool
) -> None:
    """Once this server stops, ask the other API servers to stop too: they drain their
    requests meanwhile."""
    while not server.should_exit:
        await asyncio.sleep(STOP_POLL_S)
    api_stopping.value = True  # NOTE: before the SIGTERMs: they act on them only then
    for p in api_servers:
        if p.is_alive():
            p.terminate()


def _shared_metrics_dir(api_server_count: int) -> str | None:
    """With several API servers, a private directory for their request metrics, named
    in the environment before any of them imports prometheus-client; else None."""
    if api_server_count == 1:
        return None
    assert "prometheus_client" not in sys.modules, "it reads the variable at import"
    root = tempfile.mkdtemp(prefix="gyrfalcon-metrics-")
    os.environ[MULTIPROC_DIR_ENV] = root
    return root


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
    metrics_dir = _shared_metrics_dir(args.num_api_servers)
    try:
        return _serve(args)
    finally:
        if metrics_dir is not None:
            shutil.rmtree(metrics_dir, ignore_errors=True)


def _run_rank(*worker_args: object) -> None:
    """A worker's spawn target: imports the worker (torch, the model code) in the child,
    so the launcher spawns its ranks before importing any of it."""
    from gyrfalcon.worker.process import run_worker

    run_worker(*worker_args)  # type: ignore[arg-type]


def _serve(args: ServerArgs) -> int:
    from gyrfalcon.loader.resolve import default_model_name, serve_model_or_exit
    from gyrfalcon.scheduler.process import run_scheduler

    model_dir, model_cfg, args = serve_model_or_exit(args)
    tokenizer_dir = args.tokenizer or model_dir
    name = args.served_model_name or default_model_name(args.model)

    # NOTE: one worker process per rank; all below (sockets, processes, readiness,
    # results) is written for layout.world_size
    layout = RankLayout(dp_size=args.dp_size, tp_size=args.tp_size)
    if args.joins_process_groups() and args.dist_init_addr is None:
        # NOTE: not the HTTP port: the server binds it only after the ranks start
        port = free_port(avoid=args.port)
        args = dataclasses.replace(args, dist_init_addr=f"tcp://127.0.0.1:{port}")
    local = args.node_ranks()  # NOTE: all ranks but on several nodes
    ports, nodes = None, None
    if args.nnodes > 1:
        assert args.dist_init_addr is not None  # NOTE: ServerArgs asks for it
        ports = NodePorts(*parse_init_addr(args.dist_init_addr), layout.world_size)
        nodes = NodeWatch(ports, args.nnodes)
        logger.info(
            "head of %d nodes: ranks %d..%d here, %d..%d on the others (ports %d..%d)",
            args.nnodes, local.start, local.stop - 1, local.stop, layout.world_size - 1,
            ports.port, ports.port + 2 + layout.world_size,
        )  # fmt: skip
    num_api = args.num_api_servers
    paths, ipc_root = IpcPaths.create(layout.world_size, ports, len(local), num_api)
    ctx = mp.get_context("spawn")
    # NOTE: no lock: the children read it inside a signal handler.
    stopping = ctx.RawValue(ctypes.c_bool, False)
    scheduler_args = (args, paths, model_cfg, layout, stopping)
    procs: list[BaseProcess] = [
        ctx.Process(target=run_scheduler, args=scheduler_args, name="scheduler")
    ]
    for rank in local:
        endpoints = paths.worker_endpoints(rank)
        worker_args = (args, endpoints, model_dir, model_cfg, rank, layout, stopping)
        procs.append(ctx.Process(target=_run_rank, args=worker_args, name=f"worker{rank}"))
    # NOTE: a flag of their own: they stop (and drain) while the engine still runs
    api_stopping = ctx.RawValue(ctypes.c_bool, False)
    api_servers: list[BaseProcess] = []
    for i in range(1, num_api):
        api_args = (args, paths, i, tokenizer_dir, name, api_stopping)
        api_servers.append(
            ctx.Process(target=run_api_server, args=api_args, name=api_server_name(i))
        )
    state: dict = {"code": 0, "error": ""}
    # NOTE: the children first: their imports, weights and warm-up overlap this
    # process's own imports (the frontend's: torch, transformers, xgrammar) and its
    # tokenizer. A SIGTERM until serving raises SystemExit here (_sigterm_while_starting);
    # the finally below stops them then too.
    start_children([*procs, *api_servers])
    try:
        _run_frontend(
            args, name, tokenizer_dir, model_dir, paths, procs, api_servers, api_stopping,
            nodes, state,
        )  # fmt: skip
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        # NOTE: the API servers first, given as long to drain as this one had: their
        # requests in flight need the engine
        api_stopping.value = True
        drain_s = args.shutdown_timeout + SHUTDOWN_GRACE_S + CHILD_JOIN_TIMEOUT_S
        stop_children(api_servers, drain_s)
        stopping.value = True  # NOTE: before the SIGTERMs: the children act on them only then
        stop_children(procs)
        shutil.rmtree(ipc_root, ignore_errors=True)
    logger.info("server stopped")
    return state["code"]


def _run_frontend(
    args: ServerArgs,
    name: str,
    tokenizer_dir: str,
    model_dir: str,
    paths: IpcPaths,
    procs: list[BaseProcess],
    api_servers: list[BaseProcess],
    api_stopping: ctypes.c_bool,
    nodes: NodeWatch | None,
    state: dict,
) -> None:
    """API server 0 (this process), its children already started: serve until stopped."""
    from transformers import AutoTokenizer

    from gyrfalcon.frontend.server import (
        HTTP_IMPL,
        drain_on_shutdown,
        event_loop_name,
        make_uvicorn_server,
        run_event_loop,
        shared_port_socket,
    )

    # NOTE: the frontend does no tensor math worth threads (torch is imported by now,
    # by the imports above; the children, spawned already, set their own)
    set_torch_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    logger.info(
        "serving %s (%s, %s attention) from %s on %s",
        name, args.dtype, args.attention_backend, model_dir, args.device,
    )  # fmt: skip
    num_api = args.num_api_servers
    engine = EngineClient(paths)
    app = build_app(args, engine, tokenizer, name)
    server = make_uvicorn_server(app, args.host, args.port, args.log_level, args.shutdown_timeout)

    async def main() -> None:
        logger.info("HTTP through %s on %s's event loop", HTTP_IMPL, event_loop_name())
        await engine.start()
        tasks: list[asyncio.Task] = []
        try:
            if nodes is not None:
                await nodes.start()
            sockets = None
            if num_api > 1:
                try:
                    sockets = [shared_port_socket(args.host, args.port)]
                except OSError as e:
                    logger.error("cannot bind %s:%d: %s", args.host, args.port, e)
                    state["code"], state["error"] = 1, str(e)
                    return
                logger.info("%d API servers on %s:%d (SO_REUSEPORT)", num_api, args.host, args.port)
                tasks.append(
                    asyncio.create_task(_stop_api_servers_with(server, api_servers, api_stopping))
                )
            tasks.append(
                asyncio.create_task(_watchdog(procs, api_servers, nodes, server, engine, state))
            )
            tasks.append(
                asyncio.create_task(drain_on_shutdown(server, engine, args.shutdown_timeout))
            )
            tasks.append(asyncio.create_task(freeze_when_ready(engine, 0)))
            await server.serve(sockets=sockets)
        finally:
            for task in tasks:
                task.cancel()
            engine.close()
            if nodes is not None:  # NOTE: the other nodes stop their ranks meanwhile
                await nodes.close(state["error"])

    signal.signal(signal.SIGTERM, lambda *_: _on_sigterm(server))
    run_event_loop(main())
