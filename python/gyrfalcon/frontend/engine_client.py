"""The frontend's side of the frontend <-> scheduler edge.

One PUSH socket carries `GenerateRequest | AbortRequest | StatsRequest` to the
scheduler; one PULL socket brings back `EngineReady | BatchOutput | StatsReply
| EngineError`. A background reader task routes each `RequestOutput` to the
queue of its request id, so many HTTP requests share the two sockets. A request's
consumer takes whatever has queued for it as one output (`merge_outputs`).

With several API servers (--api-server-count) each has its own client and PULL
socket (`api_server` indexes `IpcPaths.scheduler_to_frontends`); they share the
scheduler's PULL.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Callable

import msgspec
import zmq
import zmq.asyncio

from gyrfalcon.ipc.messages import (
    AbortRequest,
    BatchOutput,
    EngineError,
    EngineReady,
    GenerateRequest,
    RequestOutput,
    SamplingParams,
    SchedulerToFrontend,
    StatsReply,
    StatsRequest,
)
from gyrfalcon.ipc.sockets import AsyncChannel, IpcPaths

logger = logging.getLogger(__name__)

FINISH_ERROR = "error"  # the finish_reason of a request the engine failed


def merge_outputs(*outputs: RequestOutput) -> RequestOutput:
    """Consecutive outputs of one request as one: the tokens and their logprobs in
    order, the prompt logprobs (sent once) from whichever has them, and everything
    that describes the request so far (finish, counts, error) from the last."""
    last = outputs[-1]
    assert all(o.rid == last.rid for o in outputs), [o.rid for o in outputs]
    assert all(o.finish_reason is None for o in outputs[:-1]), "an output after a finish"
    logprobs = None
    if any(o.logprobs is not None for o in outputs):
        logprobs = [p for o in outputs for p in o.logprobs or ()]
    prompt = next((o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None), None)
    tokens = [t for o in outputs for t in o.token_ids]
    return msgspec.structs.replace(
        last, token_ids=tokens, logprobs=logprobs, prompt_logprobs=prompt
    )


class EngineDeadError(RuntimeError):
    """The engine reported a fatal error (or was declared dead); no new work."""


class EngineClient:
    """Async client of the scheduler process, used by the HTTP handlers.

    Attributes:
        ready: set once the scheduler sent `EngineReady`.
        info: that `EngineReady` message, or None before it arrives.
        dead: the fatal error text once the engine is dead, else None.
    """

    def __init__(self, paths: IpcPaths, api_server: int = 0) -> None:
        self.paths = paths
        self.api_server = api_server
        # NOTE: with several API servers each prefixes its request ids with its index,
        # so two of them never send the scheduler one id ("<digits>:" is prefix-free)
        several = len(paths.scheduler_to_frontends) > 1
        self._rid_prefix = f"{api_server}:" if several else ""
        self.ready = asyncio.Event()
        self.info: EngineReady | None = None
        self.dead: str | None = None
        self._ctx: zmq.asyncio.Context | None = None
        self._push: AsyncChannel | None = None
        self._pull: AsyncChannel | None = None
        self._reader: asyncio.Task[None] | None = None
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._stats_waiters: dict[int, asyncio.Future[StatsReply]] = {}
        self._nonces = itertools.count()
        # NOTE: strong references to fire-and-forget sends (aborts from closed
        # generators); the event loop keeps only weak references to tasks.
        self._background: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Connect both sockets and start routing scheduler messages."""
        self._ctx = zmq.asyncio.Context()
        self._push = AsyncChannel(self._ctx, zmq.PUSH, self.paths.frontend_to_scheduler, bind=False)
        self._pull = AsyncChannel(
            self._ctx,
            zmq.PULL,
            self.paths.scheduler_to_frontends[self.api_server],
            bind=False,
            decode_type=SchedulerToFrontend,
        )
        self._reader = asyncio.create_task(self._read_loop(), name="engine-client-reader")

    @property
    def num_in_flight(self) -> int:
        """Requests whose outputs are still being routed."""
        return len(self._queues)

    async def generate(
        self,
        rid: str,
        prompt_ids: list[int],
        sampling: SamplingParams,
        observe: Callable[[RequestOutput], None] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit one request and yield its outputs until one has a finish_reason; the
        outputs queued while the consumer was busy come as one (`merge_outputs`), each
        of them first handed to `observe` (the request's metrics) as it came.

        If the consumer stops early (the generator is closed or cancelled), the
        request is aborted in the scheduler. Raises EngineDeadError when the
        engine is dead, ValueError when `rid` is already in flight. The outputs carry
        `rid` as the scheduler knows it (with this API server's prefix, if any).
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        rid = self._rid_prefix + rid
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already in flight")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[rid] = queue
        finished = False
        try:
            await self._send(GenerateRequest(rid, prompt_ids, sampling, self.api_server))
            while True:
                # NOTE: a consumer behind the engine takes what is queued as one output:
                # under load the per-output work (detokenizing, one SSE chunk, the
                # client's parse) is paid per batch of tokens, not per token
                parts = [await queue.get()]
                while parts[-1].finish_reason is None and not queue.empty():
                    parts.append(queue.get_nowait())
                if observe is not None:
                    for part in parts:
                        observe(part)
                out = parts[0] if len(parts) == 1 else merge_outputs(*parts)
                if out.finish_reason is not None:
                    finished = True
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished and self.dead is None:
                # NOTE: sent from a separate task: this block may run inside a
                # cancelled scope (client disconnect), where awaiting is not safe.
                self._spawn_abort(rid)

    async def abort(self, rid: str) -> None:
        """Ask the scheduler to drop `rid`; its consumer gets a final "abort" output."""
        if self.dead is None:
            await self._send(AbortRequest(rid=self._rid_prefix + rid))

    async def stats(self, timeout: float) -> StatsReply:
        """Round-trip a `StatsRequest`; raises TimeoutError, or EngineDeadError."""
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        nonce = next(self._nonces)
        fut: asyncio.Future[StatsReply] = asyncio.get_running_loop().create_future()
        self._stats_waiters[nonce] = fut
        try:
            await self._send(StatsRequest(nonce=nonce, api_server=self.api_server))
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError as exc:  # a distinct class before Python 3.11
            raise TimeoutError(f"no StatsReply within {timeout} s") from exc
        finally:
            self._stats_waiters.pop(nonce, None)

    def mark_dead(self, message: str) -> None:
        """Declare the engine dead (e.g. the launcher saw a process exit).

        Every in-flight request gets a final "error" output; later calls fail.
        """
        if self.dead is not None:
            return
        self.dead = message
        logger.error("engine is dead: %s", message)
        for rid, queue in self._queues.items():
            queue.put_nowait(
                RequestOutput(rid=rid, token_ids=[], finish_reason=FINISH_ERROR, error=message)
            )
        for fut in self._stats_waiters.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(message))

    def close(self) -> None:
        """Stop the reader and close the sockets (idempotent)."""
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        for task in self._background:
            task.cancel()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # ------------------------------------------------------------ internals

    async def _send(self, msg: GenerateRequest | AbortRequest | StatsRequest) -> None:
        if self._push is None:
            raise RuntimeError("EngineClient.start() was not called")
        await self._push.send(msg)

    def _spawn_abort(self, rid: str) -> None:
        task = asyncio.get_running_loop().create_task(self._abort_quietly(rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _abort_quietly(self, rid: str) -> None:
        try:
            await self._send(AbortRequest(rid=rid))
        except Exception:  # closed sockets at shutdown: nothing left to free
            logger.warning("could not send abort for %s", rid, exc_info=True)

    async def _read_loop(self) -> None:
        assert self._pull is not None
        try:
            while True:
                self._dispatch(await self._pull.recv())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a malformed message or a closed socket
            logger.exception("engine reader failed")
            self.mark_dead(f"frontend lost the engine connection: {exc!r}")

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, BatchOutput):
            for out in msg.outputs:
                queue = self._queues.get(out.rid)
                # NOTE: outputs of requests whose consumer left (the trailing
                # "abort" output, in-flight tokens) have no queue: dropped.
                if queue is not None:
                    queue.put_nowait(out)
        elif isinstance(msg, EngineReady):
            self.info = msg
            self.ready.set()
        elif isinstance(msg, StatsReply):
            fut = self._stats_waiters.get(msg.nonce)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, EngineError):
            self.mark_dead(msg.message)
