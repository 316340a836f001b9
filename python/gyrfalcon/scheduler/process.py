"""The scheduler process: frontend messages in, step plans to the worker, outputs back."""

from __future__ import annotations

import ctypes
import logging
import sys

import zmq

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
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
from gyrfalcon.ipc.sockets import Channel, IpcPaths
from gyrfalcon.scheduler.scheduler import Scheduler, SchedulerConfig
from gyrfalcon.scheduler.step_log import ThroughputLog
from gyrfalcon.utils import ChildStop, set_torch_threads, setup_child

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50  # wait for frontend input when there is no work
WORKER_POLL_MS = 1000  # liveness check period while waiting for the worker


class WorkerFailed(Exception):
    pass


class StopRequested(Exception):
    """The launcher stopped the server (or is gone) while we waited for the worker."""


class SchedulerLoop:
    def __init__(self, args: ServerArgs, paths: IpcPaths, model_cfg: ModelConfig, stop: ChildStop):
        self.args, self.model_cfg = args, model_cfg
        self.stop = stop
        ctx = zmq.Context()
        self.from_frontend = Channel(
            ctx, zmq.PULL, paths.frontend_to_scheduler, True, FrontendToScheduler
        )
        self.to_frontend = Channel(ctx, zmq.PUSH, paths.scheduler_to_frontend, True)
        self.to_worker = Channel(ctx, zmq.PUSH, paths.scheduler_to_worker, True)
        self.from_worker = Channel(
            ctx, zmq.PULL, paths.worker_to_scheduler, True, WorkerToScheduler
        )
        self.sched: Scheduler | None = None
        self.throughput_log = ThroughputLog(args.log_stats_interval)

    def _recv_worker(self) -> WorkerReady | StepResult:
        while True:
            msg = self.from_worker.recv(WORKER_POLL_MS)
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
        ready = self._recv_worker()
        assert isinstance(ready, WorkerReady)
        a = self.args
        self.sched = Scheduler(
            SchedulerConfig.from_args(
                a, ready.num_kv_pages, ready.max_model_len, self.model_cfg.eos_token_ids
            )
        )
        self.to_frontend.send(EngineReady(ready.max_model_len, ready.num_kv_pages, a.page_size))
        logger.info(
            "engine ready: %d KV pages of %d tokens, context %d",
            ready.num_kv_pages,
            a.page_size,
            ready.max_model_len,
        )

    def _handle(self, msg: object) -> None:
        assert self.sched is not None
        if isinstance(msg, GenerateRequest):
            self.sched.add_request(msg)
        elif isinstance(msg, AbortRequest):
            self.sched.abort(msg.rid)
        elif isinstance(msg, StatsRequest):
            self.to_frontend.send(self.sched.stats(msg.nonce))

    def step(self) -> None:
        sched = self.sched
        assert sched is not None
        timeout = 0 if sched.has_work() else IDLE_POLL_MS
        msg = self.from_frontend.recv(timeout)
        while msg is not None:
            self._handle(msg)
            msg = self.from_frontend.recv(0)
        outputs: list[RequestOutput] = sched.pump(self.to_worker.send, self._recv_result)
        if outputs:
            self.to_frontend.send(BatchOutput(outputs))
        alloc = sched.alloc
        line = self.throughput_log.line(
            sched.counters,
            len(sched.running),
            len(sched.waiting),
            alloc.num_usable - alloc.num_free,
            alloc.num_usable,
        )
        if line is not None:
            logger.info("%s", line)

    def run(self) -> None:
        """Serve until the launcher stops us (or is gone); exits 1 if the worker fails."""
        try:
            self.start()
            self.stop.serving()
            while not (self.stop.requested or self.stop.parent_gone()):
                self.step()
        except StopRequested:
            pass
        except WorkerFailed as e:
            logger.error("%s", e)
            if self.sched is not None:
                self.to_frontend.send(BatchOutput(self.sched.fail_all(str(e))))
            self.to_frontend.send(EngineError(str(e)))
            sys.exit(1)
        finally:
            # NOTE: a PUSH send blocks while no worker is connected (not started yet, or
            # dead): give up at once then.
            self.to_worker.sock.setsockopt(zmq.SNDTIMEO, 0)
            try:
                self.to_worker.send(Shutdown())
            except zmq.Again:
                pass


def run_scheduler(
    args: ServerArgs, paths: IpcPaths, model_cfg: ModelConfig, stopping: ctypes.c_bool
) -> None:
    """Entry point of the scheduler process."""
    stop = setup_child("scheduler", args.log_level, stopping)
    set_torch_threads(1)  # no tensor math here
    SchedulerLoop(args, paths, model_cfg, stop).run()
