"""ZMQ socket helpers: PUSH/PULL pairs over ipc:// paths in a private temp dir."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio


@dataclass(frozen=True)
class IpcPaths:
    """The four endpoints of a single-worker deployment."""

    frontend_to_scheduler: str
    scheduler_to_frontend: str
    scheduler_to_worker: str
    worker_to_scheduler: str

    @classmethod
    def create(cls) -> tuple[IpcPaths, str]:
        """Make a private 0700 directory and endpoint names inside it."""
        root = tempfile.mkdtemp(prefix="gyrfalcon-")
        os.chmod(root, 0o700)

        def ep(name: str) -> str:
            return f"ipc://{os.path.join(root, name)}"

        return cls(ep("f2s"), ep("s2f"), ep("s2w"), ep("w2s")), root


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
