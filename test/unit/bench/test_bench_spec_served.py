"""benchmarks/bench_spec.py against a fake chat server (no gyrfalcon server started): its
requests at each concurrency, waves, rounds alternating the servers, A/B trees beside
them, and main()'s reports."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from aiohttp import web
from fake_http import ThreadedApp

from gyrfalcon.bench.datasets import SampleRequest


class FakeChatServer(ThreadedApp):
    """Non-streamed chat completions on a free port, in a thread: the answer echoes the
    prompt; with `spec` set, usage carries the spec fields (and `corrupt` changes one)."""

    def __init__(self, arrivals: list[tuple[int, str]] | None = None) -> None:
        self.spec = self.corrupt = False
        self.leaked = 0  # KV pages /server_info reports missing after the runs
        self.in_flight = self.most_in_flight = 0
        self.arrivals = arrivals  # (id(self), prompt) of each request, where given
        super().__init__()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake"}]})

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        assert body["stream"] is False and body["temperature"] == 0.0
        prompt = body["messages"][0]["content"]
        if self.arrivals is not None:
            self.arrivals.append((id(self), prompt))
        if prompt == "fail":
            return web.Response(status=500, text="boom")
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.02)
        self.in_flight -= 1
        text = f"echo {prompt}" + (" !" if self.corrupt and prompt == "q2" else "")
        usage = {"prompt_tokens": 3, "completion_tokens": len(text.split())}
        if self.spec:
            usage |= {"spec_accept_length": 1.5, "spec_verify_steps": 2}
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "finish_reason": "stop"}  # fmt: skip
        return web.json_response({"choices": [choice], "usage": usage})

    async def _server_info(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "num_running": 0,
                "num_waiting": 0,
                "integrity_ok": True,
                "num_free_pages": 64 - self.leaked,
                "num_total_pages": 64,
            }
        )

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/server_info", self._server_info)


@pytest.fixture
def server() -> Iterator[FakeChatServer]:
    with FakeChatServer() as s:
        yield s


def test_run_concurrencies_keeps_order_and_limit(bs: ModuleType, server: FakeChatServer) -> None:
    server.spec = True
    prompts = ["q0", "q1", "fail", "q3", "q4", "q5"]
    samples = [SampleRequest(prompt=p, prompt_len=None, output_len=4) for p in prompts]
    runs = asyncio.run(bs.run_concurrencies(server.url, samples, [2], 30.0))
    outputs, duration = runs[2]
    assert duration > 0 and server.most_in_flight == 2
    assert [o.text for o in outputs] == ["echo q0", "echo q1", "", "echo q3", "echo q4", "echo q5"]
    assert "HTTP 500: boom" in outputs[2].error and not outputs[2].ok
    assert outputs[0].spec_verify_steps == 2 and outputs[0].completion_tokens == 2


def test_min_waves_cycle_the_prompts(bs: ModuleType, server: FakeChatServer) -> None:
    """At concurrency C, --min-waves W sends max(prompts, W * C) requests, the prompts
    in order and cycled; the report compares them with the first concurrency's outputs
    of the same prompts."""
    assert bs.cycled([1, 2, 3], 1, 2) == [1, 2, 3]
    assert bs.cycled([1, 2, 3], 4, 2) == [1, 2, 3, 1, 2, 3, 1, 2]
    samples = [SampleRequest(prompt=p, prompt_len=None, output_len=4) for p in ("a", "b")]
    runs = asyncio.run(bs.run_concurrencies(server.url, samples, [1, 3], 30.0, min_waves=2))
    assert [o.text for o in runs[1][0]] == ["echo a", "echo b"]
    assert [o.text for o in runs[3][0]] == ["echo a", "echo b"] * 3
    assert server.most_in_flight == 3
    ns, extra = bs.parse_args(["--concurrency", "1,3", "--min-waves", "2"])
    report = bs.build_report(ns, extra, 2, {"plain": [], "spec": []}, {"plain": runs, "spec": runs})
    assert [r["requests"] for r in report["rows"]] == [2, 6]
    assert report["rows"][1]["plain_vs_first_concurrency"] == 0 and report["min_waves"] == 2
    assert "(cycled to at least 2 x the concurrency requests)" in bs.format_markdown(report)


@pytest.mark.parametrize(
    "corrupt, device, leak",
    [(False, "auto", 0), (True, "auto", 0), (True, "cuda", 0), (False, "cuda", 1)],
    ids=["ok", "bad", "bad-bf16", "leaked-page"],
)
def test_main_writes_reports(
    bs: ModuleType, server: FakeChatServer, tmp_path: Path, monkeypatch, corrupt: bool,
    device: str, leak: int,
) -> None:  # fmt: skip
    """Mismatches fail the run in float32 (auto on the CPU), and are reported but not
    fatal in bf16 (auto on CUDA), where near-ties flip with the kernels. Each server's KV
    pages after its runs are reported, and a page not back fails the run."""

    @contextlib.contextmanager
    def fake_server(cmd: list[str], port: int, log: Path, timeout: float, *_: Any) -> Iterator[str]:
        server.spec = "--speculative-algorithm" in cmd
        server.corrupt = corrupt and server.spec
        server.leaked = leak if server.spec else 0
        yield server.url

    monkeypatch.setattr(bs, "running_server", fake_server)
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"turns": [f"q{i}", "later"]}) + "\n" for i in range(4)))
    argv = ["--dataset", str(data), "--concurrency", "1,3", "--output-dir", str(tmp_path),
            "--log-dir", str(tmp_path / "logs"), "--device-kind", "cpu-test", "--max-tokens", "8",
            "--model", "/models/tiny", "--load-format", "dummy", "--device", device]  # fmt: skip
    assert bs.main(argv) == (1 if corrupt and device == "auto" or leak else 0)
    report = json.loads((tmp_path / "spec_tiny_k3_cpu-test.json").read_text())
    plain = report["pages"]["plain"]
    assert (plain["free"], plain["total"], plain["integrity_ok"], plain["ok"]) == (
        64,
        64,
        True,
        True,
    )
    assert (
        report["pages"]["spec"]["ok"] == (not leak) and report["pages"]["spec"]["free"] == 64 - leak
    )
    assert report["num_prompts"] == 4 and report["max_tokens"] == 8
    assert report["server_args"] == ["--load-format", "dummy"]
    assert "--speculative-draft-model-path" in report["commands"]["spec"]
    for row in report["rows"]:
        assert row["plain_vs_spec"]["mismatches"] == (1 if corrupt else 0)
        assert row["acceptance"]["accept_length_mean_per_request"] == 1.5
    markdown = (tmp_path / "spec_tiny_k3_cpu-test.md").read_text()
    assert "| 3 | 4 |" in markdown
    assert (
        f"KV pages after the runs: plain 64 of 64 free, integrity ok; spec {64 - leak} of 64"
        in markdown
    )


def test_rounds_need_a_kv_cap_and_alternate_the_servers(bs: ModuleType) -> None:
    """--rounds R: both servers up at once, each round of a concurrency sent to one then
    the other, the order alternating; a server's outputs and wall time sum its rounds,
    and each round's figures are kept."""
    for argv in (["--rounds", "2"], ["--rounds", "0", "--kv-cache-memory", "1GiB"]):
        with pytest.raises(SystemExit):
            bs.parse_args(argv)
    ns, extra = bs.parse_args(["--rounds", "2", "--kv-cache-memory=1GiB"])
    assert ns.rounds == 2 and extra == ["--kv-cache-memory=1GiB"]
    arrivals: list[tuple[int, str]] = []
    with FakeChatServer(arrivals) as plain, FakeChatServer(arrivals) as spec:
        spec.spec = True
        samples = [SampleRequest(prompt=p, prompt_len=None, output_len=4) for p in ("a", "b")]
        urls = {"plain": plain.url, "spec": spec.url}
        runs, figures = asyncio.run(bs.run_rounds(urls, samples, [1, 2], 30.0, rounds=3))
    who = {id(plain): "plain", id(spec): "spec"}
    order = [who[s] for s, _ in arrivals[2:]]  # NOTE: after one warm-up request each
    even, odd = ["plain"] * 2 + ["spec"] * 2, ["spec"] * 2 + ["plain"] * 2
    assert order == (even + odd + even) * 2  # rounds 0, 1, 2 at concurrency 1, then 2
    for name in ("plain", "spec"):
        for c in (1, 2):
            outputs, wall = runs[name][c]
            assert [o.text for o in outputs] == ["echo a", "echo b"] * 3
            assert len(figures[name][c]) == 3 and [t for t, _ in figures[name][c]] == [4] * 3
            assert wall == pytest.approx(sum(w for _, w in figures[name][c]))
    ns, extra = bs.parse_args(["--concurrency", "1,2", "--rounds", "3", "--kv-cache-memory=1G"])
    report = bs.build_report(ns, extra, 2, {"plain": [], "spec": []}, runs, figures)
    assert report["rounds"] == 3 and [r["requests"] for r in report["rows"]] == [6, 6]
    assert all(len(r["rounds_output_throughput"]["spec"]) == 3 for r in report["rows"])
    assert all(r["rounds_accept_length"] == [1.0] * 3 for r in report["rows"])
    for c in (1, 2):  # NOTE: the last round's requests emit 2 tokens a verify step
        outs, wall = runs["spec"][c]
        last = [
            dataclasses.replace(o, completion_tokens=2 * o.spec_verify_steps) for o in outs[-2:]
        ]
        runs["spec"][c] = (outs[:-2] + last, wall)
    report = bs.build_report(ns, extra, 2, {"plain": [], "spec": []}, runs, figures)
    assert all(r["rounds_accept_length"] == [1.0, 1.0, 2.0] for r in report["rows"])
    md = bs.format_markdown(report)
    assert "3 rounds, both servers up at once" in md
    assert "EAGLE3 accept length per round: c1: 1.00 / 1.00 / 2.00; c2: 1.00 / 1.00 / 2.00" in md
    # the last round kept its texts, not its acceptance
    assert "whose acceptance did: c1: 0 and 0 of 2 / 0 and 2 of 2; c2: 0 and 0 of 2" in md


def test_main_with_rounds_runs_both_servers_at_once(
    bs: ModuleType, tmp_path: Path, monkeypatch
) -> None:
    open_now: list[str] = []
    most_open = 0
    with FakeChatServer() as plain, FakeChatServer() as spec:
        spec.spec = True

        @contextlib.contextmanager
        def fake_server(
            cmd: list[str], port: int, log: Path, timeout: float, *_: Any
        ) -> Iterator[str]:
            nonlocal most_open
            name = "spec" if "--speculative-algorithm" in cmd else "plain"
            open_now.append(name)
            most_open = max(most_open, len(open_now))
            try:
                yield (spec if name == "spec" else plain).url
            finally:
                open_now.remove(name)

        monkeypatch.setattr(bs, "running_server", fake_server)
        data = tmp_path / "q.jsonl"
        data.write_text("".join(json.dumps({"turns": [f"q{i}"]}) + "\n" for i in range(3)))
        argv = ["--dataset", str(data), "--concurrency", "2", "--output-dir", str(tmp_path),
                "--device-kind", "cpu-test", "--model", "/models/tiny", "--rounds", "2",
                "--kv-cache-memory", "1GiB"]  # fmt: skip
        assert bs.main(argv) == 0
    assert most_open == 2 and not open_now
    report = json.loads((tmp_path / "spec_tiny_k3_cpu-test.json").read_text())
    assert report["rows"][0]["requests"] == 6 and report["server_args"] == [
        "--kv-cache-memory",
        "1GiB",
    ]


def test_ab_trees_serve_beside_the_two_in_the_same_rounds(
    bs: ModuleType, tmp_path: Path, monkeypatch
) -> None:
    """--ab-trees: an EAGLE3 server per source tree (gyrfalcon imported from
    DIR/python), all four up at once, each round sent to every server; each tree's
    rows against the one plain server in `ab_rows` and the markdown; the exit code
    counts their failures too."""
    with pytest.raises(SystemExit):  # NOTE: beside the others only
        bs.parse_args(["--ab-trees", "a,b", "--kv-cache-memory", "1GiB"])
    started: dict[str, Path] = {}
    open_now: list[str] = []
    most_open = 0
    with FakeChatServer() as plain, FakeChatServer() as spec, FakeChatServer() as old:
        spec.spec = old.spec = True
        old.corrupt = True  # NOTE: bf16 here: mismatches reported, not fatal

        @contextlib.contextmanager
        def fake_server(cmd: list[str], port: int, log: Path, timeout: float, python_dir, *_):
            nonlocal most_open
            name = log.stem.removeprefix("server_")
            started[name] = python_dir
            open_now.append(name)
            most_open = max(most_open, len(open_now))
            try:
                yield {"plain": plain, "spec": spec}.get(name, old).url
            finally:
                open_now.remove(name)

        monkeypatch.setattr(bs, "running_server", fake_server)
        data = tmp_path / "q.jsonl"
        data.write_text("".join(json.dumps({"turns": [f"q{i}"]}) + "\n" for i in range(3)))
        trees = [tmp_path / "ab" / "abc1234", tmp_path / "ab" / "abc1234_nopack"]
        argv = ["--dataset", str(data), "--concurrency", "1,2", "--output-dir", str(tmp_path),
                "--device-kind", "cpu-test", "--model", "/models/tiny", "--rounds", "2",
                "--kv-cache-memory", "1GiB", "--device", "cuda",
                "--ab-trees", ",".join(map(str, trees))]  # fmt: skip
        assert bs.main(argv) == 0
    assert most_open == 4 and not open_now
    assert started["spec_abc1234"] == trees[0] / "python"
    assert started["spec_abc1234_nopack"] == trees[1] / "python"
    assert started["plain"] == started["spec"] == bs.ROOT / "python"
    report = json.loads((tmp_path / "spec_tiny_k3_cpu-test.json").read_text())
    assert set(report["ab_rows"]) == {"spec@abc1234", "spec@abc1234_nopack"}
    for name, rows in report["ab_rows"].items():
        assert [r["concurrency"] for r in rows] == [1, 2] and rows[0]["requests"] == 6
        assert rows[0]["speedup"] is not None and rows[0]["plain_vs_spec"]["mismatches"] == 2
        assert len(rows[0]["rounds_output_throughput"][name]) == 2
        assert len(rows[0]["rounds_accept_length"]) == 2
    md = (tmp_path / "spec_tiny_k3_cpu-test.md").read_text()
    assert "| spec@abc1234_nopack | 2 | " in md and "| 2 of 6 | 0 |" in md
