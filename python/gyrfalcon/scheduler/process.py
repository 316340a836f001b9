"""The scheduler process: frontend messages in, step plans to the workers, outputs back.

Written for N worker ranks (`RankLayout`): every plan goes to every rank (one
PUSH socket each, encoded once), every rank's `WorkerReady` is collected before
the engine reports ready (the smallest KV pool and context win), and each DP
group's results come from its first TP rank over one shared PULL socket.

And for M API servers (--api-server-count): one PUSH socket each; a request's
outputs and a stats reply go to the API server that sent it (`OutputRouter`),
readiness and a fatal error to all.
"""

from __future__ import annotations

import ctypes
import logging
import sys

import msgspec
import zmq

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.gc_heap import GcPauses, freeze_startup_heap
from gyrfalcon.ipc.contract import RankLayout
from gyrfalcon.ipc.messages import (
    AbortRequest,
    BatchOutput,
    EngineError,
    EngineReady,
    FrontendToScheduler,
    GenerateRequest,
    RequestOutput,
    Shutdown,
    StatsRequest,
    StepResult,
    WorkerError,
    WorkerReady,
    WorkerToScheduler,
)
from gyrfalcon.ipc.sockets import Channel, Fanout, IpcPaths
from gyrfalcon.profiling import process_profile
from gyrfalcon.scheduler.routing import OutputRouter
from gyrfalcon.scheduler.scheduler import Scheduler, SchedulerConfig
from gyrfalcon.scheduler.step_log import ThroughputLog
from gyrfalcon.utils import ChildStop, set_torch_threads, setup_child

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50  # wait for frontend input when there is no work
WORKER_POLL_MS = 1000  # liveness check period while waiting for the workers


class WorkerFailed(Exception):
    pass


class StopRequested(Exception):
    """The launcher stopped the server (or is gone) while we waited for the worker."""


class SchedulerLoop:
    def __init__(
        self,
        args: ServerArgs,
        paths: IpcPaths,
        model_cfg: ModelConfig,
        stop: ChildStop,
        layout: RankLayout,
    ):
        assert len(paths.scheduler_to_workers) == layout.world_size, "one endpoint per rank"
        self.args, self.model_cfg, self.layout = args, model_cfg, layout
        self.stop = stop
        ctx = zmq.Context()
        self.from_frontend = Channel(
            ctx, zmq.PULL, paths.frontend_to_scheduler, True, FrontendToScheduler
        )
        self.to_frontends = Fanout(ctx, paths.scheduler_to_frontends)
        self.router = OutputRouter(len(paths.scheduler_to_frontends))
        self.to_workers = Fanout(ctx, paths.scheduler_to_workers)
        self.from_workers = Channel(
            ctx, zmq.PULL, paths.worker_to_scheduler, True, WorkerToScheduler
        )
        self.sched: Scheduler | None = None
        self.throughput_log = ThroughputLog(args.log_stats_interval)

    def _recv_worker(self) -> WorkerReady | StepResult:
        while True:
            msg = self.from_workers.recv(WORKER_POLL_MS)
            if msg is None:
                if self.stop.requested or self.stop.parent_gone():
                    raise StopRequested
                continue
            if isinstance(msg, WorkerError):
                raise WorkerFailed(f"worker {msg.rank} failed: {msg.message}")
            return msg

    def _recv_result(self) -> StepResult:
        result = self._recv_worker()
        assert isinstance(result, StepResult), f"expected a step result, got {result}"
        return result

    def start(self) -> None:
        """Wait for every rank's WorkerReady; size the scheduler by the smallest."""
        ready: dict[int, WorkerReady] = {}
        while len(ready) < self.layout.world_size:
            msg = self._recv_worker()
            assert isinstance(msg, WorkerReady), f"expected WorkerReady, got {msg}"
            assert msg.rank not in ready, f"rank {msg.rank} reported ready twice"
            ready[msg.rank] = msg
        num_pages = min(r.num_kv_pages for r in ready.values())
        context = min(r.max_model_len for r in ready.values())
        a = self.args
        eos = self.model_cfg.eos_token_ids
        floats = all(r.floats_rows for r in ready.values())
        cfg = SchedulerConfig.from_args(
            a, num_pages, context, eos, dp_size=self.layout.dp_size, float_rows=floats
        )
        self.sched = Scheduler(cfg)
        ready = EngineReady(context, num_pages, a.page_size, a.num_draft_tokens, cfg.prefix_caching)
        # NOTE: API server 0 last: a send blocks until its API server has connected, so
        # once the launcher's own server reports ready every other one has its message
        for i in reversed(range(self.router.num_servers)):
            self.to_frontends.send_to(i, ready)
        logger.info(
            "engine ready: %d worker rank(s), %d KV pages of %d tokens per DP rank, context %d",
            self.layout.world_size,
            num_pages,
            a.page_size,
            context,
        )

    def _handle(self, msg: object) -> None:
        assert self.sched is not None
        if isinstance(msg, GenerateRequest):
            self.router.add(msg.rid, msg.api_server)
            self.sched.add_request(msg)
        elif isinstance(msg, AbortRequest):
            self.sched.abort(msg.rid)
        elif isinstance(msg, StatsRequest):
            reply = self.sched.stats(msg.nonce)
            leak = self.router.check(self.sched.live_rids())
            if leak is not None and reply.integrity_ok:
                reply = msgspec.structs.replace(reply, integrity_ok=False, integrity_error=leak)
            self.to_frontends.send_to(msg.api_server, reply)

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        """One BatchOutput to each API server with outputs of its requests."""
        for i, mine in enumerate(self.router.split(outputs)):
            if mine:
                self.to_frontends.send_to(i, BatchOutput(mine))

    def step(self) -> None:
        sched = self.sched
        assert sched is not None
        timeout = 0 if sched.has_work() else IDLE_POLL_MS
        msg = self.from_frontend.recv(timeout)
        while msg is not None:
            self._handle(msg)
            msg = self.from_frontend.recv(0)
        outputs: list[RequestOutput] = sched.pump(self.to_workers.send, self._recv_result)
        if outputs:
            self._send_outputs(outputs)
        line = self.throughput_log.line(
            sched.counters,
            len(sched.running),
            len(sched.waiting),
            sched.num_usable_pages - sched.num_free_pages,
            sched.num_usable_pages,
        )
        if line is not None:
            logger.info("%s", line)

    def run(self) -> None:
        """Serve until the launcher stops us (or is gone); exits 1 if a worker fails."""
        pauses = GcPauses()
        try:
            self.start()
            freeze_startup_heap()
            pauses.install()
            self.stop.serving()
            while not (self.stop.requested or self.stop.parent_gone()):
                self.step()
        except StopRequested:
            pass
        except WorkerFailed as e:
            logger.error("%s", e)
            if self.sched is not None:
                self._send_outputs(self.sched.fail_all(str(e)))
            self.to_frontends.send(EngineError(str(e)))
            sys.exit(1)
        finally:
            # NOTE: a PUSH send blocks while no worker is connected (not started yet, or
            # dead): skip such a rank.
            self.to_workers.send_nowait(Shutdown())
            logger.info("scheduler: %s", pauses.summary())


def run_scheduler(
    args: ServerArgs,
    paths: IpcPaths,
    model_cfg: ModelConfig,
    layout: RankLayout,
    stopping: ctypes.c_bool,
) -> None:
    """Entry point of the scheduler process."""
    stop = setup_child("scheduler", args.log_level, stopping)
    set_torch_threads(1)  # no tensor math here
    with process_profile("scheduler"):
        SchedulerLoop(args, paths, model_cfg, stop, layout).run()
