"""Typed messages of the node <-> head edge (msgspec structs, tagged unions): the
heartbeats between the process of each node other than the head and the head's
launcher, over one DEALER (node) / ROUTER (head) pair (`gyrfalcon/node_link.py`)."""

from __future__ import annotations

import msgspec


class NodeHeartbeat(msgspec.Struct, tag=True):
    """Node `node_rank` is alive; sent every heartbeat period. The sizes let the head
    refuse a node started with other flags."""

    node_rank: int
    nnodes: int
    world_size: int


class NodeFailed(msgspec.Struct, tag=True):
    """Node `node_rank` stops serving (a worker of it died, or it was told to stop):
    the head cannot go on without its ranks."""

    node_rank: int
    message: str


class HeadAck(msgspec.Struct, tag=True):
    """The head's answer to each heartbeat: the head is alive."""


class HeadStopping(msgspec.Struct, tag=True):
    """The head is stopping: `error` says why when it failed ("" for an ordered stop)."""

    error: str = ""


NodeToHead = NodeHeartbeat | NodeFailed
HeadToNode = HeadAck | HeadStopping
