"""Heartbeats between the head and another node (node_link.py) over real local TCP
sockets: joining, the head's stop, a node's failure, a node started with other flags,
two processes claiming one node, and each side falling silent."""

from __future__ import annotations

import asyncio

import zmq

from gyrfalcon import node_link
from gyrfalcon.ipc.node_messages import HeadStopping
from gyrfalcon.ipc.sockets import NodePorts
from gyrfalcon.node_link import HeadLink, NodeWatch
from gyrfalcon.utils import free_port

WORLD = 2


def ports() -> NodePorts:
    # NOTE: only P + 2 is bound here
    return NodePorts("127.0.0.1", free_port() - 2, WORLD)


def head_link(ctx: zmq.Context, p: NodePorts, nnodes: int, node_rank: int, name: str) -> HeadLink:
    """A node's end, named `name`: one test process plays several node processes."""
    link = HeadLink(ctx, p, nnodes, node_rank)
    endpoint = p.connect(node_link.HEARTBEAT_OFFSET)
    link.sock.disconnect(endpoint)
    link.sock.setsockopt(zmq.ROUTING_ID, name.encode())
    link.sock.connect(endpoint)
    return link


async def until(cond, link: HeadLink | None = None, timeout_s: float = 5.0):
    """Run the event loop (the watch) and `link` until cond() is truthy; its value."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not (got := cond()):
        assert loop.time() < deadline, "timed out"
        if link is not None:
            link.beat()
            link.poll(0)
        await asyncio.sleep(0.02)
    return got


def test_a_node_joins_and_stops_with_the_head():
    async def body() -> None:
        p = ports()
        watch = NodeWatch(p, nnodes=2)
        await watch.start()
        ctx = zmq.Context()
        link = HeadLink(ctx, p, nnodes=2, node_rank=1)
        try:
            await until(lambda: 1 in watch._last_seen and link._last_ack is not None, link)
            assert watch.check() is None and link.head_gone() is None
            await watch.close("")
            stop = await until(lambda: link.poll(0))
            assert stop == HeadStopping("")
        finally:
            link.close()
            ctx.term()

    asyncio.run(body())


def test_a_failed_node_and_a_node_with_other_flags_stop_the_head():
    async def body() -> None:
        p = ports()
        watch = NodeWatch(p, nnodes=2)
        await watch.start()
        ctx = zmq.Context()
        link = head_link(ctx, p, 2, 1, "a")
        other = head_link(ctx, NodePorts(p.host, p.port, WORLD * 2), 2, 1, "b")
        try:
            await until(lambda: link._last_ack, link)
            link.fail("worker1 exited unexpectedly (exit code -9)")
            assert await until(watch.check) == "node 1: worker1 exited unexpectedly (exit code -9)"
            watch.failure = None
            other.beat()
            assert "start every node with the same --tp-size" in await until(watch.check)
        finally:
            await watch.close("")
            for end in (link, other):
                end.close()
            ctx.term()

    asyncio.run(body())


def test_two_processes_calling_themselves_node_1_are_refused():
    async def body() -> None:
        p = ports()
        watch = NodeWatch(p, nnodes=3)
        await watch.start()
        ctx = zmq.Context()
        links = [head_link(ctx, p, 3, 1, name) for name in ("a", "b")]
        try:
            await until(lambda: watch._last_seen, links[0])
            links[1].beat()
            assert "two processes say they are node 1" in await until(watch.check)
        finally:
            await watch.close("")
            for link in links:
                link.close()
            ctx.term()

    asyncio.run(body())


def test_each_side_notices_the_other_falling_silent(monkeypatch):
    monkeypatch.setattr(node_link, "HEARTBEAT_TIMEOUT_S", 0.3)
    monkeypatch.setattr(node_link, "JOIN_TIMEOUT_S", 0.3)

    async def body() -> None:
        p = ports()
        watch = NodeWatch(p, nnodes=2)  # NOTE: node 1 never comes
        await watch.start()
        assert "node 1 did not join within" in await until(watch.check)
        await watch.close("")
        watch = NodeWatch(p, nnodes=2)
        await watch.start()
        ctx = zmq.Context()
        link = HeadLink(ctx, p, nnodes=2, node_rank=1)
        try:
            await until(lambda: link._last_ack, link)
            # the node stops beating: the head notices; the head stops acking: the node does
            assert "node 1 stopped answering" in await until(watch.check)
            assert "stopped answering" in await until(link.head_gone)
        finally:
            await watch.close("")
            link.close()
            ctx.term()

    asyncio.run(body())
