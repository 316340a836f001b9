"""benchmarks/bench_spec.py: flags, acceptance from usage, output comparison, reports;
its requests and main() against a fake chat server (no gyrfalcon server started)."""

from __future__ import annotations

import argparse
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
from bench_scripts import bench_script
from fake_http import ThreadedApp

from gyrfalcon.bench import spec_report
from gyrfalcon.bench.datasets import SampleRequest
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.config.speculative import resolve_speculative


@pytest.fixture(scope="module")
def bs() -> Iterator[ModuleType]:
    with bench_script("bench_spec.py") as mod:
        yield mod


def out(bs: ModuleType, text: str = "a b", tokens: int = 2, **kw: Any) -> Any:
    return bs.ChatOutput(text=text, completion_tokens=tokens, finish_reason="stop", **kw)


def test_parse_args_defaults_and_passthrough(bs: ModuleType) -> None:
    ns, extra = bs.parse_args([])
    assert ns.concurrency == [1, 16] and ns.num_steps == 3 and ns.max_tokens == 256
    assert ns.model is None and ns.dataset.endswith("data/mt_bench_dev.jsonl")
    assert ns.draft_model.endswith("models/smollm2-eagle3") and extra == []
    argv = ["--num-steps", "5", "--load-format", "dummy", "--concurrency", "4,1,4"]
    ns, extra = bs.parse_args([*argv, "--tokenizer", "/tok", "--device", "cpu"])
    assert ns.num_steps == 5 and ns.concurrency == [4, 1] and ns.device == "cpu"
    assert extra == ["--load-format", "dummy", "--tokenizer", "/tok"]


def test_parse_concurrency(bs: ModuleType) -> None:
    assert bs.parse_concurrency(" 1, 16,64 ,16") == [1, 16, 64]
    for bad in ("0", "", "1,-2"):
        with pytest.raises(ValueError):
            bs.parse_concurrency(bad)
    with pytest.raises(SystemExit):
        bs.parse_args(["--concurrency", "0"])
    with pytest.raises(SystemExit):
        bs.parse_args(["--num-steps", "0"])


def test_server_commands_parse_as_server_args(bs: ModuleType) -> None:
    argv = ["--model", "/m", "--draft-model", "/d", "--num-steps", "2", "--load-format", "dummy",
            "--spec-flags", "--separate-prefill-steps --max-num-seqs 7"]  # fmt: skip
    ns, extra = bs.parse_args(argv)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    for spec in (False, True):
        cmd = bs.server_command(ns, extra, 8123, spec)
        assert cmd[1:4] == ["-m", "gyrfalcon.cli", "serve"]
        args = ServerArgs.from_cli_args(parser.parse_args(cmd[4:]))
        assert (args.model, args.port, args.load_format) == ("/m", 8123, "dummy")
        steps = resolve_speculative(
            args.speculative_algorithm, args.speculative_draft_model_path,
            args.speculative_num_steps, args.speculative_eagle_topk,
            args.speculative_num_draft_tokens,
        )  # fmt: skip
        assert steps == ((2, 3) if spec else (None, None))
        assert args.speculative_draft_model_path == ("/d" if spec else None)
        # --spec-flags reach the EAGLE3 server alone
        assert args.separate_prefill_steps is spec
        assert args.max_num_seqs == (7 if spec else ServerArgs.max_num_seqs)
    ns, _ = bs.parse_args([])
    assert bs.server_command(ns, [], 1, False)[4] == "--port"  # no model: the embedded one


def test_file_tag(bs: ModuleType) -> None:
    ns, _ = bs.parse_args(["--device-kind", "cpu-2core"])
    assert bs.file_tag(ns) == "spec_smollm2-135m-instruct_k3_cpu-2core"
    ns, _ = bs.parse_args(["--model", "benchmarks/models/llama-3.1-8b", "--device-kind", "h"])
    assert bs.file_tag(ns) == "spec_llama-3.1-8b_k3_h"
    ns, _ = bs.parse_args(["--tag", "x", "--num-steps", "5"])
    assert bs.file_tag(ns) == "spec_x_k5_unknown"


def test_parse_chat_response_reads_spec_usage(bs: ModuleType) -> None:
    body = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi."},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8,
                  "spec_accept_length": 1.5, "spec_verify_steps": 2},
    }  # fmt: skip
    o = bs.parse_chat_response(body)
    assert (o.text, o.completion_tokens, o.finish_reason) == ("Hi.", 3, "stop")
    assert (o.spec_accept_length, o.spec_verify_steps, o.ok) == (1.5, 2, True)
    del body["usage"]["spec_accept_length"], body["usage"]["spec_verify_steps"]
    o = bs.parse_chat_response(body)
    assert o.spec_accept_length is None and o.spec_verify_steps is None


def test_chat_payload_is_greedy_and_unstreamed(bs: ModuleType) -> None:
    p = bs.chat_payload("m", SampleRequest(prompt="q?", prompt_len=None, output_len=7))
    assert p == {
        "model": "m", "temperature": 0.0, "max_tokens": 7, "stream": False,
        "messages": [{"role": "user", "content": "q?"}],
    }  # fmt: skip


def test_acceptance_token_weighted_and_mean(bs: ModuleType) -> None:
    outputs = [
        out(bs, tokens=10, spec_accept_length=2.25, spec_verify_steps=4),
        out(bs, tokens=7, spec_accept_length=3.0, spec_verify_steps=2),
        out(bs, tokens=9, spec_accept_length=9.0, spec_verify_steps=1, error="HTTP 500"),
        out(bs, tokens=1, spec_accept_length=1.0, spec_verify_steps=0),  # one token: no verify
    ]
    acc = spec_report.acceptance(outputs)
    assert acc["requests_with_spec_usage"] == 3 and acc["requests_verified"] == 2
    assert acc["total_verify_steps"] == 6
    assert acc["accept_length_token_weighted"] == pytest.approx(17 / 6)
    assert acc["accept_length_per_verify_step"] == pytest.approx((2.25 * 4 + 3.0 * 2) / 6)
    assert acc["accept_length_mean_per_request"] == pytest.approx(2.625)
    none = spec_report.acceptance([out(bs), out(bs, error="x")])
    assert none["requests_with_spec_usage"] == 0
    assert none["accept_length_token_weighted"] is None
    assert none["accept_length_mean_per_request"] is None


def test_throughput_counts_successful_tokens(bs: ModuleType) -> None:
    t = spec_report.throughput([out(bs, tokens=30), out(bs, tokens=10), out(bs, error="e")], 4.0)
    assert (t["completed"], t["failed"], t["output_tokens"]) == (2, 1, 40)
    assert t["output_throughput"] == 10.0
    assert spec_report.throughput([], 0.0)["output_throughput"] == 0.0


def test_first_difference(bs: ModuleType) -> None:
    assert spec_report.first_difference("abc", "abd") == 2
    assert spec_report.first_difference("ab", "abc") == 2
    assert spec_report.first_difference("", "x") == 0


def test_compare_outputs_counts_mismatches_and_failures(bs: ModuleType) -> None:
    plain = [out(bs, "same"), out(bs, "one two three"), out(bs, "x"), out(bs, "y"), out(bs, "z")]
    spec = [
        out(bs, "same"),
        out(bs, "one two four"),  # text differs
        out(bs, "x", tokens=3),  # same text, another token count
        bs.ChatOutput(text="y", completion_tokens=2, finish_reason="length"),
        out(bs, "", error="HTTP 500"),  # failed: not compared
    ]
    c = spec_report.compare_outputs(plain, spec)
    assert (c["compared"], c["failed_pairs"], c["mismatches"]) == (4, 1, 3)
    first = c["examples"][0]
    assert first["prompt_index"] == 1 and first["first_difference_char"] == 8
    assert first["snippets"] == ["one two three", "one two four"]
    assert len(spec_report.compare_outputs(plain, spec, shown=1)["examples"]) == 1
    assert spec_report.compare_outputs(plain, plain)["mismatches"] == 0


def fake_runs(bs: ModuleType, spec_texts: list[str]) -> dict[str, Any]:
    plain = [out(bs, t, tokens=8) for t in ("a", "b")]
    spec = [out(bs, t, tokens=8, spec_accept_length=2.0, spec_verify_steps=4) for t in spec_texts]
    return {
        "plain": {1: (plain, 2.0), 16: (plain, 1.0)},
        "spec": {1: (spec, 1.0), 16: (spec, 0.8)},
    }


def test_report_json_and_markdown(bs: ModuleType) -> None:
    ns, extra = bs.parse_args(["--device-kind", "cpu-test", "--load-format", "dummy"])
    runs = fake_runs(bs, ["a", "B"])
    report = bs.build_report(ns, extra, 2, {"plain": ["p"], "spec": ["s"]}, runs)
    json.loads(json.dumps(report, allow_nan=False))  # strict JSON
    assert [r["concurrency"] for r in report["rows"]] == [1, 16]
    row = report["rows"][0]
    assert row["speedup"] == pytest.approx(2.0) and row["plain_vs_spec"]["mismatches"] == 1
    assert row["acceptance"]["accept_length_token_weighted"] == pytest.approx(2.0)
    assert row["plain_vs_first_concurrency"] == 0
    assert "text" not in report["per_request"]["16"]["spec"][0]
    assert report["per_request"]["16"]["spec"][0]["spec_verify_steps"] == 4
    md = bs.format_markdown(report)
    assert "(device kind: cpu-test)" in md and "`--load-format dummy`" in md
    assert "| 1 | 2 | 2.00 | 2.00 | 8.0 | 16.0 | 2.00x | 1 of 2 | 0 |" in md
    assert "| 16 | 2 | 2.00 | 2.00 | 16.0 | 20.0 | 1.25x | 1 of 2 | 0 |" in md
    assert "first concurrency" not in md  # plain did not drift between concurrencies


class FakeChatServer(ThreadedApp):
    """Non-streamed chat completions on a free port, in a thread: the answer echoes the
    prompt; with `spec` set, usage carries the spec fields (and `corrupt` changes one)."""

    def __init__(self, arrivals: list[tuple[int, str]] | None = None) -> None:
        self.spec = self.corrupt = False
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

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)


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
    "corrupt, device",
    [(False, "auto"), (True, "auto"), (True, "cuda")],
    ids=["ok", "bad", "bad-bf16"],
)
def test_main_writes_reports(
    bs: ModuleType, server: FakeChatServer, tmp_path: Path, monkeypatch, corrupt: bool, device: str
) -> None:
    """Mismatches fail the run in float32 (auto on the CPU), and are reported but not
    fatal in bf16 (auto on CUDA), where near-ties flip with the kernels."""

    @contextlib.contextmanager
    def fake_server(cmd: list[str], port: int, log: Path, timeout: float, *_: Any) -> Iterator[str]:
        server.spec = "--speculative-algorithm" in cmd
        server.corrupt = corrupt and server.spec
        yield server.url

    monkeypatch.setattr(bs, "running_server", fake_server)
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"turns": [f"q{i}", "later"]}) + "\n" for i in range(4)))
    argv = ["--dataset", str(data), "--concurrency", "1,3", "--output-dir", str(tmp_path),
            "--log-dir", str(tmp_path / "logs"), "--device-kind", "cpu-test", "--max-tokens", "8",
            "--model", "/models/tiny", "--load-format", "dummy", "--device", device]  # fmt: skip
    assert bs.main(argv) == (1 if corrupt and device == "auto" else 0)
    report = json.loads((tmp_path / "spec_tiny_k3_cpu-test.json").read_text())
    assert report["num_prompts"] == 4 and report["max_tokens"] == 8
    assert report["server_args"] == ["--load-format", "dummy"]
    assert "--speculative-draft-model-path" in report["commands"]["spec"]
    for row in report["rows"]:
        assert row["plain_vs_spec"]["mismatches"] == (1 if corrupt else 0)
        assert row["acceptance"]["accept_length_mean_per_request"] == 1.5
    assert "| 3 | 4 |" in (tmp_path / "spec_tiny_k3_cpu-test.md").read_text()


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
        trees = [tmp_path / "ab" / "abc1234", tmp_path / "ab" / "abc1234+nopack"]
        argv = ["--dataset", str(data), "--concurrency", "1,2", "--output-dir", str(tmp_path),
                "--device-kind", "cpu-test", "--model", "/models/tiny", "--rounds", "2",
                "--kv-cache-memory", "1GiB", "--device", "cuda",
                "--ab-trees", ",".join(map(str, trees))]  # fmt: skip
        assert bs.main(argv) == 0
    assert most_open == 4 and not open_now
    assert started["spec_abc1234"] == trees[0] / "python"
    assert started["spec_abc1234+nopack"] == trees[1] / "python"
    assert started["plain"] == started["spec"] == bs.ROOT / "python"
    report = json.loads((tmp_path / "spec_tiny_k3_cpu-test.json").read_text())
    assert set(report["ab_rows"]) == {"spec@abc1234", "spec@abc1234+nopack"}
    for name, rows in report["ab_rows"].items():
        assert [r["concurrency"] for r in rows] == [1, 2] and rows[0]["requests"] == 6
        assert rows[0]["speedup"] is not None and rows[0]["plain_vs_spec"]["mismatches"] == 2
        assert len(rows[0]["rounds_output_throughput"][name]) == 2
        assert len(rows[0]["rounds_accept_length"]) == 2
    md = (tmp_path / "spec_tiny_k3_cpu-test.md").read_text()
    assert "| spec@abc1234+nopack | 2 | " in md and "| 2 of 6 | 0 |" in md
