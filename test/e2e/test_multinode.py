"""Two nodes on one host (`--nnodes 2`, one rank each, gloo): a tiny Llama split tp 2
over them answers a greedy batch exactly like the one-rank server and both stop on the
head's SIGTERM; a rank killed on node 1 takes the head down, and a head killed whole
(its process group: as if its machine died) takes node 1 down, each within 30 s with
no process left behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import pytest
from conftest import make_tiny_hf_model
from server_util import (
    alive,
    children_of,
    rss_kb,
    serve_command,
    serve_greedy,
    spawn_serve,
    start_server,
    stop_server,
)

from gyrfalcon.utils import free_port

PROMPTS = [[5, 9, 17, 33, 60], [7] * 12, list(range(3, 30))]
DEATH_S = 30  # the bound on noticing a dead rank or node
WORLD = 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[str, tuple[str, ...]]:
    """A tiny Llama (4 heads, 2 KV heads: tp 2 splits both) and the flags it runs with."""
    from gyrfalcon.bench.synthetic_tokenizer import make_synthetic_tokenizer

    root = tmp_path_factory.mktemp("multinode")
    model, tok = str(root / "model"), str(root / "tok")
    make_tiny_hf_model(model, "llama")
    make_synthetic_tokenizer(model, tok)
    flags = ("--tokenizer", tok, "--page-size", "4", "--num-kv-pages", "64", "--cpu-threads", "1")
    return model, flags


def free_init_port() -> int:
    """A port P with P .. P + 2 + WORLD free here: the store and the head's sockets."""
    for _ in range(100):
        port = free_port()
        try:
            for p in range(port, port + 3 + WORLD):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no run of free ports")


def node_flags(port: int, node: int) -> tuple[str, ...]:
    addr = f"127.0.0.1:{port}"  # NOTE: SGLang's form, no tcp://
    return ("--tp-size", "2", "--nnodes", "2", "--node-rank", str(node), "--dist-init-addr", addr)


def start_node1(tiny, port: int, log_path: str) -> subprocess.Popen:
    """Node 1's process; the head comes up only once its rank is ready."""
    model, flags = tiny
    return spawn_serve(serve_command(model, free_port(), *flags, *node_flags(port, 1)), log_path)


def kill_all(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_two_nodes_answer_like_one_rank_and_stop_with_the_head(tiny, tmp_path):
    model, flags = tiny
    want = serve_greedy(model, str(tmp_path / "one.log"), PROMPTS, 12, *flags).out
    port = free_init_port()
    node_log = str(tmp_path / "node1.log")
    node = start_node1(tiny, port, node_log)
    try:
        got = serve_greedy(
            model, str(tmp_path / "head.log"), PROMPTS, 12, *flags, *node_flags(port, 0)
        )
        assert node.wait(DEATH_S) == 0  # NOTE: the head said it stops
    finally:
        kill_all(node)
    for (tokens, lps), (want_tokens, want_lps) in zip(got.out, want):
        assert tokens == want_tokens
        assert lps == pytest.approx(want_lps, abs=1e-4)
    info = got.info
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info
    assert "node 1 joined: ranks 1..1" in got.log and "2 worker rank(s)" in got.log
    with open(node_log) as f:
        log = f.read()
    assert "node 1 of 2: serving ranks 1..1 of 2" in log and "the head stops" in log, log


def two_nodes(tiny, tmp_path):
    """(head server, node 1's process, every process of both) once the head is healthy."""
    model, flags = tiny
    port = free_init_port()
    node = start_node1(tiny, port, str(tmp_path / "node1.log"))
    try:
        head = start_server(model, str(tmp_path / "head.log"), *flags, *node_flags(port, 0))
    except BaseException:
        kill_all(node)
        raise
    procs = [head.proc.pid, node.pid, *children_of(head.proc.pid), *children_of(node.pid)]
    return head, node, procs


def test_a_dead_rank_on_node_1_takes_the_head_down(tiny, tmp_path):
    """SIGKILL node 1's worker: node 1 tells the head, which exits non-zero within 30 s;
    node 1 too; nothing is left."""
    head, node, procs = two_nodes(tiny, tmp_path)
    try:
        worker = max((k for k in children_of(node.pid) if alive(k)), key=rss_kb)  # the model's
        os.kill(worker, signal.SIGKILL)
        start = time.monotonic()
        code = head.proc.wait(DEATH_S)
        took = time.monotonic() - start
        assert node.wait(DEATH_S) != 0
    finally:
        stop_server(head)
        kill_all(node)
    assert code != 0 and took < DEATH_S, head.log()[-3000:]
    assert "node 1: worker1 exited unexpectedly (exit code -9)" in head.log(), head.log()[-3000:]
    time.sleep(0.5)
    assert not [p for p in procs if alive(p)]


def test_a_dead_head_takes_node_1_down(tiny, tmp_path):
    """SIGKILL every process of the head at once (no goodbye from any): node 1 misses
    the head's acks, stops its rank and exits non-zero within 30 s."""
    head, node, procs = two_nodes(tiny, tmp_path)
    try:
        os.killpg(head.proc.pid, signal.SIGKILL)
        start = time.monotonic()
        code = node.wait(DEATH_S)
        took = time.monotonic() - start
    finally:
        stop_server(head)
        kill_all(node)
    with open(tmp_path / "node1.log") as f:
        log = f.read()
    assert code != 0 and took < DEATH_S and "stopped answering" in log, log[-3000:]
    time.sleep(0.5)
    assert not [p for p in procs if alive(p)]
