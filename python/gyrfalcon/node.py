"""A node other than the head (`gyrfalcon serve ... --nnodes N --node-rank n`, n > 0):
this node's worker ranks as children, no HTTP server, no scheduler.

Its ranks reach the head's scheduler over TCP (ipc/sockets.NodePorts) and meet the
others in torch.distributed at --dist-init-addr. This process is their launcher:
it keeps a heartbeat with the head (node_link.HeadLink) and exits

- 0 when the head says it stops, or on SIGINT/SIGTERM (telling the head first,
  which cannot serve without these ranks);
- non-zero when one of its workers dies (the head is told, and stops the server),
  when the head fails, or when the head stops answering (it was killed).

Its workers are stopped as the head's are (utils.stop_children), and get SIGTERM
from the kernel if this process dies (`PR_SET_PDEATHSIG`), so nothing is orphaned.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import signal
from multiprocessing.process import BaseProcess

import zmq

from gyrfalcon.config.nodes import parse_init_addr
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.ipc.contract import RankLayout
from gyrfalcon.ipc.sockets import NodePorts
from gyrfalcon.node_link import HeadLink
from gyrfalcon.utils import configure_logging, dead_child, start_children, stop_children

logger = logging.getLogger("gyrfalcon")

WATCHDOG_PERIOD_MS = 500  # how often the workers and the head are checked


class _Signalled:
    """SIGINT/SIGTERM once the workers run: stop at the next check (an ordered stop)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def __call__(self, signum: int, _frame: object) -> None:
        self.signum = signum


def _exit_while_starting(*_: object) -> None:
    logger.info("SIGTERM while starting: stopping")
    raise SystemExit(0)


def serve_node(args: ServerArgs) -> int:
    """Run this node's ranks until the head stops or one side fails; the exit code."""
    name = f"node{args.node_rank}"
    configure_logging(args.log_level, name)
    signal.signal(signal.SIGTERM, _exit_while_starting)  # no child to stop yet
    from gyrfalcon.loader.resolve import serve_model_or_exit
    from gyrfalcon.worker.process import run_worker

    model_dir, model_cfg, args = serve_model_or_exit(args)  # NOTE: every node loads its own
    layout = RankLayout(dp_size=args.dp_size, tp_size=args.tp_size)
    assert args.dist_init_addr is not None  # NOTE: ServerArgs asks for it with --nnodes > 1
    ports = NodePorts(*parse_init_addr(args.dist_init_addr), layout.world_size)
    ranks = args.node_ranks()
    logger.info(
        "node %d of %d: serving ranks %d..%d of %d on %s, no HTTP server; the head is at %s:%d",
        args.node_rank, args.nnodes, ranks.start, ranks.stop - 1, layout.world_size,
        args.device, ports.host, ports.port,
    )  # fmt: skip
    ctx = mp.get_context("spawn")
    stopping = ctx.RawValue(ctypes.c_bool, False)  # NOTE: as in launch.py: read in a handler
    procs: list[BaseProcess] = []
    for rank in ranks:
        worker_args = (
            args, ports.worker_endpoints(rank), model_dir, model_cfg, rank, layout, stopping
        )  # fmt: skip
        procs.append(ctx.Process(target=run_worker, args=worker_args, name=f"worker{rank}"))
    signalled = _Signalled()
    signal.signal(signal.SIGTERM, signalled)
    signal.signal(signal.SIGINT, signalled)
    zctx = zmq.Context()
    link = HeadLink(zctx, ports, args.nnodes, args.node_rank)
    start_children(procs)
    try:
        code = _watch(name, procs, link, signalled)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stopping.value = True  # NOTE: before the SIGTERMs: the children act on them only then
        stop_children(procs)
        link.close()
        zctx.term()
    logger.info("node %d stopped", args.node_rank)
    return code


def _watch(name: str, procs: list[BaseProcess], link: HeadLink, signalled: _Signalled) -> int:
    """Heartbeats to the head and checks of both sides until one says stop."""
    while True:
        link.beat()
        stop = link.poll(WATCHDOG_PERIOD_MS)
        if stop is not None:
            if stop.error:
                logger.error("the head failed: %s; stopping", stop.error)
                return 1
            logger.info("the head stops: stopping")
            return 0
        if signalled.signum is not None:
            why = f"{name} was stopped ({signal.Signals(signalled.signum).name})"
            logger.info("%s", why)
            link.fail(why)
            return 0
        dead = dead_child(procs)
        if dead is not None:
            why = f"{dead.name} exited unexpectedly (exit code {dead.exitcode})"
            if dead.exitcode == 0:  # NOTE: a Shutdown plan: the scheduler stopped (or died)
                why = f"the head's scheduler shut {dead.name} down"
            logger.error("%s; stopping", why)
            link.fail(why)
            return 1
        gone = link.head_gone()
        if gone is not None:
            logger.error("%s; stopping", gone)
            return 1
