"""ZMQ socket helpers: PUSH/PULL pairs over ipc:// paths in a private temp dir, and
over TCP to the ranks of other nodes (`NodePorts`)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio

# Several nodes (--nnodes > 1): the head's TCP ports, all derived from the port P of
# --dist-init-addr. torch.distributed's store (rank 0's) listens on P itself.
WORKERS_TO_SCHEDULER_OFFSET = 1  # P + 1: the scheduler's PULL; every rank connects
HEARTBEAT_OFFSET = 2  # P + 2: the head's ROUTER; every other node process connects
SCHEDULER_TO_WORKER_OFFSET = 3  # P + 3 + r: the scheduler's PUSH to rank r off the head
ANY_INTERFACE = "*"  # NOTE: the head binds all of them: its name may resolve to loopback
LOCALHOST = "127.0.0.1"  # where the head's own ranks reach the TCP sockets
MAX_PORT = 65535


@dataclass(frozen=True)
class NodePorts:
    """The head's TCP endpoints of a multi-node deployment: `host` is the head's address
    as the other nodes reach it and `port` the --dist-init-addr port (offsets above).
    The head binds them on every interface; workers connect to `host`."""

    host: str
    port: int
    world_size: int

    def __post_init__(self) -> None:
        last = self.port + SCHEDULER_TO_WORKER_OFFSET + self.world_size - 1
        if last > MAX_PORT:
            raise ValueError(
                f"--dist-init-addr port {self.port}: the nodes' sockets need ports up to {last}"
            )

    def bind(self, offset: int) -> str:
        return f"tcp://{ANY_INTERFACE}:{self.port + offset}"

    def connect(self, offset: int) -> str:
        return f"tcp://{self.host}:{self.port + offset}"

    def worker_endpoints(self, rank: int) -> WorkerEndpoints:
        """What rank (on a node other than the head) connects to."""
        return WorkerEndpoints(
            self.connect(SCHEDULER_TO_WORKER_OFFSET + rank),
            self.connect(WORKERS_TO_SCHEDULER_OFFSET),
        )


@dataclass(frozen=True)
class WorkerEndpoints:
    """The two endpoints one worker rank connects to: its own plans' PULL and the
    PUSH of readiness, results and errors that every rank shares."""

    from_scheduler: str
    to_scheduler: str


@dataclass(frozen=True)
class IpcPaths:
    """The endpoints of one deployment as the scheduler and the frontend bind them: one
    frontend -> scheduler PULL that every API server connects to, one scheduler ->
    frontend PUSH/PULL pair per API server (--api-server-count), one scheduler -> worker
    PUSH/PULL pair per worker rank (so every rank gets every plan), and one worker ->
    scheduler PULL that all ranks connect to (readiness, results, errors). With several
    nodes the ranks off the head and the shared PULL are TCP endpoints (`NodePorts`);
    the rest stay ipc://."""

    frontend_to_scheduler: str
    scheduler_to_frontends: tuple[str, ...]  # indexed by API server
    scheduler_to_workers: tuple[str, ...]  # indexed by worker rank
    worker_to_scheduler: str

    @property
    def scheduler_to_frontend(self) -> str:
        """API server 0's (the launcher's own) endpoint."""
        return self.scheduler_to_frontends[0]

    @classmethod
    def create(
        cls,
        num_workers: int = 1,
        nodes: NodePorts | None = None,
        head_ranks: int = 0,
        num_frontends: int = 1,
    ) -> tuple[IpcPaths, str]:
        """Make a private 0700 directory and endpoint names inside it; with `nodes`,
        ranks from `head_ranks` on (those of the other nodes) get TCP endpoints."""
        assert num_workers >= 1 and num_frontends >= 1, (num_workers, num_frontends)
        assert nodes is None or nodes.world_size == num_workers, (nodes, num_workers)
        root = tempfile.mkdtemp(prefix="gyrfalcon-")
        os.chmod(root, 0o700)

        def ep(name: str) -> str:
            return f"ipc://{os.path.join(root, name)}"

        def to_worker(rank: int) -> str:
            if nodes is None or rank < head_ranks:
                return ep(f"s2w{rank}")
            return nodes.bind(SCHEDULER_TO_WORKER_OFFSET + rank)

        to_workers = tuple(to_worker(rank) for rank in range(num_workers))
        # NOTE: one PULL binds one endpoint: TCP for every rank as soon as one is remote
        from_workers = ep("w2s") if nodes is None else nodes.bind(WORKERS_TO_SCHEDULER_OFFSET)
        # NOTE: API server 0 keeps the name it had before there were several
        to_frontends = tuple(ep("s2f" if i == 0 else f"s2f{i}") for i in range(num_frontends))
        return cls(ep("f2s"), to_frontends, to_workers, from_workers), root

    def worker_endpoints(self, rank: int) -> WorkerEndpoints:
        """What rank, on the head, connects to: a TCP endpoint bound on every
        interface is reached at the loopback address."""

        def connectable(endpoint: str) -> str:
            return endpoint.replace(f"tcp://{ANY_INTERFACE}:", f"tcp://{LOCALHOST}:")

        to_worker = connectable(self.scheduler_to_workers[rank])
        return WorkerEndpoints(to_worker, connectable(self.worker_to_scheduler))


class Channel:
    """A typed, blocking PUSH or PULL socket (scheduler and worker side)."""

    def __init__(
        self, ctx: zmq.Context, kind: int, endpoint: str, bind: bool, decode_type: Any = None
    ):
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        (self.sock.bind if bind else self.sock.connect)(endpoint)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(decode_type) if decode_type is not None else None

    def send(self, msg: Any) -> None:
        self.sock.send(self._enc.encode(msg), copy=False)

    def recv(self, timeout_ms: int | None = None) -> Any | None:
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            return None
        assert self._dec is not None
        return self._dec.decode(self.sock.recv(copy=False))

    def close(self, linger_ms: int = 0) -> None:
        """Close; `linger_ms` > 0 waits up to that long for queued messages to go
        (a process about to `os._exit`)."""
        self.sock.close(linger=linger_ms)


class Fanout:
    """One blocking PUSH socket per endpoint; `send` encodes a message once and
    sends it on every socket, in endpoint order (the scheduler -> every worker, or
    every API server); `send_to` sends on one."""

    def __init__(self, ctx: zmq.Context, endpoints: Sequence[str]):
        self.socks = []
        for endpoint in endpoints:
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(endpoint)
            self.socks.append(sock)
        self._enc = msgspec.msgpack.Encoder()

    def send(self, msg: Any) -> None:
        data = self._enc.encode(msg)
        for sock in self.socks:
            sock.send(data, copy=False)

    def send_to(self, index: int, msg: Any) -> None:
        self.socks[index].send(self._enc.encode(msg), copy=False)

    def send_nowait(self, msg: Any) -> None:
        """Send where a peer takes it at once; skip sockets that would block (a rank
        not connected yet, or dead)."""
        data = self._enc.encode(msg)
        for sock in self.socks:
            try:
                sock.send(data, flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                pass

    def close(self) -> None:
        for sock in self.socks:
            sock.close(linger=0)


class AsyncChannel:
    """A typed asyncio PUSH or PULL socket (frontend side)."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        kind: int,
        endpoint: str,
        bind: bool,
        decode_type: Any = None,
    ):
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        (self.sock.bind if bind else self.sock.connect)(endpoint)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(decode_type) if decode_type is not None else None

    async def send(self, msg: Any) -> None:
        await self.sock.send(self._enc.encode(msg), copy=False)

    async def recv(self) -> Any:
        assert self._dec is not None
        return self._dec.decode(await self.sock.recv(copy=False))

    def close(self) -> None:
        self.sock.close(linger=0)
