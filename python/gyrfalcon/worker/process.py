"""The worker process (one per rank): load the model, size the KV cache, execute plans.

Every rank receives every plan on its own socket and runs its DP group's batch;
the group's first TP rank (`RankLayout.reports`) sends the results. All ranks
send `WorkerReady` and, on failure, `WorkerError`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import traceback
from typing import TYPE_CHECKING

import zmq

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.gc_heap import GcPauses, freeze_startup_heap
from gyrfalcon.ipc.contract import RankLayout
from gyrfalcon.ipc.messages import SchedulerToWorker, Shutdown, StepPlan, WorkerError, WorkerReady
from gyrfalcon.ipc.sockets import Channel, WorkerEndpoints
from gyrfalcon.profiling import KernelWindow, process_profile, process_sections
from gyrfalcon.utils import ChildStop, set_torch_threads, setup_child
from gyrfalcon.worker.bootstrap import build_worker
from gyrfalcon.worker.sections import worker_sections

if TYPE_CHECKING:
    from gyrfalcon.worker.step_worker import StepWorker

logger = logging.getLogger(__name__)

POLL_MS = 1000
EXIT_LINGER_MS = 2000  # how long an exiting worker waits for its queued messages to go


def run_worker(
    args: ServerArgs,
    endpoints: WorkerEndpoints,
    model_dir: str,
    cfg: ModelConfig,
    rank: int,
    layout: RankLayout,
    stopping: ctypes.c_bool,
) -> None:
    """Entry point of a worker process; returns when its launcher (the head's, or its
    node's) stops it."""
    stop = setup_child(f"worker{rank}", args.log_level, stopping)
    set_torch_threads(args.cpu_threads)  # None (CUDA): torch's default, see ServerArgs
    ctx = zmq.Context()
    inbox = Channel(ctx, zmq.PULL, endpoints.from_scheduler, False, SchedulerToWorker)
    outbox = Channel(ctx, zmq.PUSH, endpoints.to_scheduler, False)
    code = 1
    try:
        with process_profile(f"worker{rank}"):
            _serve(args, model_dir, cfg, rank, layout, inbox, outbox, stop)
        code = 0
    except SystemExit as e:  # a stop while loading (ChildStop)
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except Exception:
        text = traceback.format_exc()
        logger.error("worker %d failed:\n%s", rank, text)
        outbox.send(WorkerError(rank, text.strip().splitlines()[-1]))
    finally:
        # NOTE: no teardown (process groups, symmetric memory, CUDA graphs): on two
        # H100s it held every worker past its grace period until killed, never
        # reaching the end of the process-group destroy (stop 43); the OS frees it
        # all. What is queued (a WorkerError, the last results) goes first.
        outbox.close(linger_ms=EXIT_LINGER_MS)
        logging.shutdown()
        os._exit(code)


def _serve(
    args: ServerArgs,
    model_dir: str,
    cfg: ModelConfig,
    rank: int,
    layout: RankLayout,
    inbox: Channel,
    outbox: Channel,
    stop: ChildStop,
) -> None:
    """Build the rank's worker, report ready, then run plans until stopped."""
    reports = layout.reports(rank)
    runner, context_len = build_worker(args, model_dir, cfg, rank, layout)
    outbox.send(
        WorkerReady(rank, runner.executor.kv_cache.num_pages, context_len, runner.floats_rows)
    )
    freeze_startup_heap()  # NOTE: the model, its graphs and caches stay for good
    pauses = GcPauses().install()
    stop.serving()
    try:
        spec = "-" + args.speculative_algorithm.lower() if args.speculative_algorithm else ""
        with process_sections(f"worker{rank}{spec}", worker_sections, lambda: runner.num_plans):
            _run_plans(runner, inbox, outbox, stop, reports, KernelWindow(f"worker{rank}"))
    finally:  # NOTE: however it stops (Shutdown, the stop flag, its parent gone)
        logger.info("rank %d: %s; %s", rank, runner.summary(), pauses.summary())


def _run_plans(
    runner: StepWorker,
    inbox: Channel,
    outbox: Channel,
    stop: ChildStop,
    reports: bool,
    kernels: KernelWindow,
) -> None:
    """Run plans as they come and send results as they are in, until stopped."""
    while not stop.requested:
        if runner.pending:
            # NOTE: spin between the next plan and the oldest step's end: a plan
            # is launched as soon as it arrives, a result sent as soon as it is in.
            if runner.oldest_done():
                result = runner.take()
                if reports:
                    outbox.send(result)
                continue
            msg = inbox.recv(0)
            if msg is None:
                continue
        else:
            runner.stats.idle(True)  # NOTE: the device has nothing left to run
            msg = inbox.recv(POLL_MS)
            if msg is None:
                if stop.parent_gone():
                    return
                continue
        if isinstance(msg, Shutdown):
            return
        assert isinstance(msg, StepPlan)
        runner.stats.idle(False)
        kernels.plan(runner.device)
        runner.submit(msg)
