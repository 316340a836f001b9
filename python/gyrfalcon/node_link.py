"""Liveness between the nodes of a multi-node deployment (--nnodes > 1).

The process of every node but the head (`node.py`) sends `NodeHeartbeat` each
HEARTBEAT_PERIOD_S over a DEALER to the head launcher's ROUTER (port P + 2 of
--dist-init-addr), and the head answers each with `HeadAck`:

- the head declares a node dead when it says so (`NodeFailed`: one of its workers
  died, or it was stopped), when its heartbeats stop for HEARTBEAT_TIMEOUT_S (the
  whole node was killed, or the network between them is gone), or when it has not
  joined JOIN_TIMEOUT_S after the head started; its watchdog then stops the server;
- a node declares the head gone when the acks stop for HEARTBEAT_TIMEOUT_S (or never
  come within JOIN_TIMEOUT_S), and stops when the head says `HeadStopping`.

Heartbeats run in the launchers, never in a worker, so a long step or a rank
waiting in a collective cannot miss one; a collective whose peer died fails
after --dist-timeout by itself (`forward/distributed.py`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

import msgspec
import zmq
import zmq.asyncio

from gyrfalcon.ipc.node_messages import (
    HeadAck,
    HeadStopping,
    HeadToNode,
    NodeFailed,
    NodeHeartbeat,
    NodeToHead,
)
from gyrfalcon.ipc.sockets import HEARTBEAT_OFFSET, NodePorts

logger = logging.getLogger("gyrfalcon")

HEARTBEAT_PERIOD_S = 1.0
# NOTE: well under the 30 s in which a dead node must take the server down, and ten
# periods: a launcher's event loop busy for a few seconds is not a death
HEARTBEAT_TIMEOUT_S = 10.0
JOIN_TIMEOUT_S = 300.0  # between the head's start and a node's (or the reverse)
QUEUED_HEARTBEATS = 4  # at most, while the head is not reachable
LAST_WORDS_LINGER_MS = 1000  # how long a closing socket may still deliver a last message


class NodeWatch:
    """The head's end: which other nodes are alive (`check`), from their heartbeats.

    `start` binds the ROUTER and answers heartbeats on the running event loop;
    `close` tells every node that joined that the head stops."""

    def __init__(self, ports: NodePorts, nnodes: int):
        self.ports, self.nnodes = ports, nnodes
        self.per_node = ports.world_size // nnodes
        self.failure: str | None = None
        self._last_seen: dict[int, float] = {}  # node -> monotonic time of its last heartbeat
        self._peers: dict[int, bytes] = {}  # node -> the routing id of its process
        self._started = time.monotonic()
        self._ctx: zmq.asyncio.Context | None = None
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task[None] | None = None
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(NodeToHead)

    async def start(self) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, LAST_WORDS_LINGER_MS)
        self._sock.bind(self.ports.bind(HEARTBEAT_OFFSET))
        self._started = time.monotonic()
        self._reader = asyncio.create_task(self._read_loop(), name="node-watch")

    def check(self) -> str | None:
        """Why the deployment cannot go on (a node failed, fell silent or never
        joined), or None."""
        if self.failure is not None:
            return self.failure
        now = time.monotonic()
        for node in range(1, self.nnodes):
            seen = self._last_seen.get(node)
            if seen is None and now - self._started > JOIN_TIMEOUT_S:
                addr = f"{self.ports.host}:{self.ports.port}"
                return (
                    f"node {node} did not join within {JOIN_TIMEOUT_S:.0f} s (is it started, "
                    f"with --dist-init-addr {addr}?)"
                )
            if seen is not None and now - seen > HEARTBEAT_TIMEOUT_S:
                return f"node {node} stopped answering (no heartbeat for {now - seen:.0f} s)"
        return None

    async def close(self, error: str) -> None:
        """Tell the nodes that joined that the head stops (`error`: why it failed, ""
        for an ordered stop), then close the socket."""
        if self._reader is not None:
            self._reader.cancel()
        if self._sock is not None:
            for peer in self._peers.values():
                await self._sock.send_multipart([peer, self._enc.encode(HeadStopping(error))])
            self._sock.close()  # NOTE: lingers LAST_WORDS_LINGER_MS to deliver them
        if self._ctx is not None:
            self._ctx.term()

    async def _read_loop(self) -> None:
        assert self._sock is not None
        while True:
            peer, data = await self._sock.recv_multipart()
            try:
                msg = self._dec.decode(data)
            except msgspec.DecodeError:  # NOTE: not ours (the port is open to the network)
                logger.warning("a malformed message on the heartbeat port: ignored")
                continue
            if isinstance(msg, NodeFailed):
                self._fail(f"node {msg.node_rank}: {msg.message}")
            elif self._accept(peer, msg):
                await self._sock.send_multipart([peer, self._enc.encode(HeadAck())])

    def _accept(self, peer: bytes, beat: NodeHeartbeat) -> bool:
        """Record a heartbeat; False (and a failure) when it comes from a node started
        with other flags, or from a second process calling itself the same node."""
        node = beat.node_rank
        if (beat.nnodes, beat.world_size) != (self.nnodes, self.ports.world_size):
            self._fail(
                f"node {node} runs {beat.world_size} ranks over {beat.nnodes} nodes, the head "
                f"{self.ports.world_size} over {self.nnodes}: start every node with the same "
                "--tp-size, --dp-size and --nnodes"
            )
            return False
        if self._peers.setdefault(node, peer) != peer:
            self._fail(f"two processes say they are node {node}: check their --node-rank")
            return False
        if node not in self._last_seen:
            first = node * self.per_node
            logger.info("node %d joined: ranks %d..%d", node, first, first + self.per_node - 1)
        self._last_seen[node] = time.monotonic()
        return True

    def _fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message


class HeadLink:
    """A node's end: heartbeats to the head, and whether the head is still there.

    Blocking: the node process's main loop calls `beat` and `poll` in turn."""

    def __init__(self, ctx: zmq.Context, ports: NodePorts, nnodes: int, node_rank: int):
        self.ports, self.node_rank = ports, node_rank
        self._beat = NodeHeartbeat(node_rank, nnodes, ports.world_size)
        self.sock = ctx.socket(zmq.DEALER)
        # NOTE: the same id across reconnects; another process claiming this node has its own
        me = f"{node_rank}@{socket.gethostname()}:{os.getpid()}"
        self.sock.setsockopt(zmq.ROUTING_ID, me.encode())
        # NOTE: no ZMQ_IMMEDIATE, which would drop a HeadStopping not read yet when the head
        # closes; instead a short queue, so few heartbeats wait for a head not up yet
        self.sock.setsockopt(zmq.SNDHWM, QUEUED_HEARTBEATS)
        self.sock.setsockopt(zmq.LINGER, LAST_WORDS_LINGER_MS)
        self.sock.connect(ports.connect(HEARTBEAT_OFFSET))
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(HeadToNode)
        self._started = time.monotonic()
        self._last_ack: float | None = None
        self._last_beat = 0.0

    def beat(self) -> None:
        """Send a heartbeat when one is due (dropped while the head is unreachable)."""
        now = time.monotonic()
        if now - self._last_beat >= HEARTBEAT_PERIOD_S:
            self._last_beat = now
            self._send(self._beat)

    def poll(self, timeout_ms: int) -> HeadStopping | None:
        """Take the head's messages for up to timeout_ms; its HeadStopping, if one came."""
        while self.sock.poll(timeout_ms):
            timeout_ms = 0
            msg = self._dec.decode(self.sock.recv())
            if isinstance(msg, HeadStopping):
                return msg
            if self._last_ack is None:
                logger.info("joined the head at %s:%d", self.ports.host, self.ports.port)
            self._last_ack = time.monotonic()
        return None

    def head_gone(self) -> str | None:
        """Why the head counts as gone (no ack for too long), or None."""
        now = time.monotonic()
        addr = f"{self.ports.host}:{self.ports.port}"
        if self._last_ack is None:
            if now - self._started > JOIN_TIMEOUT_S:
                return f"no answer from the head at {addr} within {JOIN_TIMEOUT_S:.0f} s"
            return None
        if now - self._last_ack > HEARTBEAT_TIMEOUT_S:
            return f"the head at {addr} stopped answering (no ack for {now - self._last_ack:.0f} s)"
        return None

    def fail(self, message: str) -> None:
        """Tell the head this node stops serving, and why."""
        self._send(NodeFailed(self.node_rank, message))

    def close(self) -> None:
        self.sock.close()  # NOTE: lingers LAST_WORDS_LINGER_MS to deliver a NodeFailed

    def _send(self, msg: NodeHeartbeat | NodeFailed) -> None:
        try:
            self.sock.send(self._enc.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:  # NOTE: not connected (yet, or any more): the timeouts decide
            pass
