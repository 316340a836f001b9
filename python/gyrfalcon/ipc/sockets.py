"""ZMQ socket helpers: PUSH/PULL pairs over ipc:// paths in a private temp dir."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio


@dataclass(frozen=True)
class IpcPaths:
    """The endpoints of one deployment: the frontend's pair, one scheduler -> worker
    PUSH/PULL pair per worker rank (so every rank gets every plan), and one
    worker -> scheduler PULL that all ranks connect to (readiness, results, errors)."""

    frontend_to_scheduler: str
    scheduler_to_frontend: str
    scheduler_to_workers: tuple[str, ...]  # indexed by worker rank
    worker_to_scheduler: str

    @classmethod
    def create(cls, num_workers: int = 1) -> tuple[IpcPaths, str]:
        """Make a private 0700 directory and endpoint names inside it."""
        assert num_workers >= 1, num_workers
        root = tempfile.mkdtemp(prefix="gyrfalcon-")
        os.chmod(root, 0o700)

        def ep(name: str) -> str:
            return f"ipc://{os.path.join(root, name)}"

        to_workers = tuple(ep(f"s2w{rank}") for rank in range(num_workers))
        return cls(ep("f2s"), ep("s2f"), to_workers, ep("w2s")), root


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

    def close(self) -> None:
        self.sock.close(linger=0)


class Fanout:
    """One blocking PUSH socket per endpoint; `send` encodes a message once and
    sends it on every socket, in endpoint order (the scheduler -> every worker)."""

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
