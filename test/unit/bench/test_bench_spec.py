"""benchmarks/bench_spec.py: flags, acceptance from usage, output comparison, reports
(its requests against a fake server: test_bench_spec_served.py)."""

from __future__ import annotations

import argparse
import json
from types import ModuleType
from typing import Any

import pytest

from gyrfalcon.bench import spec_report
from gyrfalcon.bench.datasets import SampleRequest
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.config.speculative import resolve_speculative


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


def test_rounds_against_first_tells_changed_texts_from_moved_acceptance(bs: ModuleType) -> None:
    def spec(text: str, steps: int = 4, **kw: Any) -> Any:
        return out(bs, text, tokens=8, spec_accept_length=2.0, spec_verify_steps=steps, **kw)

    first = [spec("a"), spec("b"), spec("c"), spec("d")]
    second = [spec("a"), spec("B"), spec("c", steps=5), spec("", error="HTTP 500")]
    third = [spec("a"), spec("b"), spec("c"), spec("d")]
    got = spec_report.rounds_against_first(first + second + third, 3)
    assert got == [
        {"compared": 3, "changed_texts": 1, "same_text_other_acceptance": 1},
        {"compared": 4, "changed_texts": 0, "same_text_other_acceptance": 0},
    ]
    assert spec_report.rounds_against_first(first, 1) == []


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
    columns = report["per_request"]["16"]["spec"]
    assert "text" not in columns and columns["spec_verify_steps"][0] == 4
    assert {len(v) for v in columns.values()} == {len(runs["spec"][16][0])}
    md = bs.format_markdown(report)
    assert "(device kind: cpu-test)" in md and "`--load-format dummy`" in md
    assert "| 1 | 2 | 2.00 | 2.00 | 8.0 | 16.0 | 2.00x | 1 of 2 | 0 |" in md
    assert "| 16 | 2 | 2.00 | 2.00 | 16.0 | 20.0 | 1.25x | 1 of 2 | 0 |" in md
    assert "first concurrency" not in md  # plain did not drift between concurrencies
