"""benchmarks/bench_multiturn.py: its conversations against a live `gyrfalcon serve` of a
tiny random model with a synthetic tokenizer, each turn's prompt the previous one plus
the exact answer the server gave plus new user ids (so the cache serves the earlier
turns, answers included); and its pure parts."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from types import ModuleType

import pytest
from bench_scripts import bench_script
from conftest import make_tiny_hf_model
from server_util import start_server, stop_server, wait_drained

from gyrfalcon.bench.token_texts import first_refused_id, ids_by_text, resolve_answer

PAGE = 16
# every answer crosses a page boundary (prompts of 56, 76, 96 tokens): the page it
# completes is cached only by decoding, and matches the next turn only with exact ids
CONVERSATIONS, TURNS, SYSTEM, USER, OUTPUT = 4, 3, 48, 8, 12


@pytest.fixture(scope="module")
def bm() -> Iterator[ModuleType]:
    with bench_script("bench_multiturn.py") as mod:
        yield mod


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from gyrfalcon.bench.synthetic_tokenizer import make_synthetic_tokenizer

    root = tmp_path_factory.mktemp("multiturn")
    model, tok = str(root / "model"), str(root / "tok")
    make_tiny_hf_model(model, "llama")
    make_synthetic_tokenizer(model, tok)
    srv = start_server(model, str(root / "server.log"), "--tokenizer", tok, "--page-size",
                       str(PAGE), "--num-kv-pages", "256", "--cpu-threads", "1")  # fmt: skip
    yield srv
    assert stop_server(srv) == 0, srv.log()[-3000:]


def test_turns_reuse_the_history_answers_included(bm, server, tmp_path):
    out = tmp_path / "run.json"
    port = server.base_url.rsplit(":", 1)[1]
    argv = [
        "--port", port, "--num-conversations", str(CONVERSATIONS), "--turns", str(TURNS),
        "--concurrency", "2", "--system-len", str(SYSTEM), "--user-len", str(USER),
        "--output-len", str(OUTPUT), "--token-range", "3,250", "--seed", "7",
        "--output-json", str(out), "--device-kind", "cpu-test", "--tag", "cache",
    ]  # fmt: skip
    assert bm.main(argv) == 0

    report = json.loads(out.read_text())
    labels = report["bench"], report["tag"], report["device_kind"]
    assert labels == ("multiturn", "cache", "cpu-test")
    assert report["args"]["token_range"] == [3, 250] and report["args"]["turns"] == TURNS
    assert report["server_version"]["version"] and report["date"] and report["commit"]
    assert report["vocab"]["size"] == 256 and report["vocab"]["ids_with_shared_text"] == 0
    s = report["summary"]
    n = CONVERSATIONS * TURNS
    assert (s["requests"], s["completed"], s["failed"]) == (n, n, 0)
    assert s["conversations_completed"] == CONVERSATIONS
    assert s["total_output_tokens"] == n * OUTPUT and s["output_throughput"] > 0
    assert s["median_ttft_ms"] > 0 and s["p90_ttft_ms"] >= s["median_ttft_ms"]
    assert s["median_tpot_ms"] > 0 and s["answer_tokens_inexact"] == 0
    rows = report["per_request"]
    assert s["total_prompt_tokens"] == sum(r["prompt_tokens"] for r in rows)
    assert s["total_cached_tokens"] == sum(r["cached_tokens"] for r in rows) > 0
    assert s["cached_ratio"] == pytest.approx(s["total_cached_tokens"] / s["total_prompt_tokens"])
    assert [t["turn"] for t in s["per_turn"]] == [1, 2, 3]
    assert all(t["completed"] == CONVERSATIONS and t["median_ttft_ms"] > 0 for t in s["per_turn"])

    for c in range(CONVERSATIONS):
        turns = sorted((r for r in rows if r["conversation"] == c), key=lambda r: r["turn"])
        assert [r["turn"] for r in turns] == [1, 2, 3]
        assert all(r["output_tokens"] == OUTPUT and r["prompt_tokens"] == r["prompt_len"]
                   for r in turns)  # fmt: skip
        assert turns[0]["prompt_tokens"] == SYSTEM + USER
        for before, after in zip(turns, turns[1:]):
            # the previous prompt + its answer + the new user ids
            assert after["prompt_tokens"] == before["prompt_tokens"] + OUTPUT + USER
            # the cache holds every page the previous turn computed (its answer but the
            # last token, never fed back), more than its prompt's pages: the page its
            # answer completed matches only if the answer's ids are exact
            computed = before["prompt_tokens"] + OUTPUT - 1
            limit = after["prompt_tokens"] - 1  # a match leaves the last token to compute
            assert after["cached_tokens"] == min(computed, limit) // PAGE * PAGE
            assert after["cached_tokens"] > before["prompt_tokens"] // PAGE * PAGE

    info = wait_drained(server)
    assert info["integrity_ok"] and info["num_running"] == info["num_waiting"] == 0, info
    assert info["num_free_pages"] == info["num_total_pages"], f"leaked KV pages: {info}"


def test_a_turn_prompt_is_the_history_then_the_new_user_ids(bm):
    w = bm.make_workload(3, 2, 5, 4, (10, 20), seed=1)
    assert w == bm.make_workload(3, 2, 5, 4, (10, 20), seed=1)
    assert len(w.system) == 5 and len(w.users) == 3
    assert all(len(u) == 4 and min(u) >= 10 and max(u) < 20 for c in w.users for u in c)
    assert w.users[0][0] != w.users[1][0] != w.users[0][1]
    assert bm.turn_prompt([1, 2], [[3]], []) == [1, 2, 3]
    assert bm.turn_prompt([1, 2], [[3], [6, 7]], [[4, 5]]) == [1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError):
        bm.turn_prompt([1], [[3]], [[4]])
    assert bm.last_prompt_len(5, 4, 3, 2) == len(bm.turn_prompt([0] * 5, [[0] * 4] * 2, [[0] * 3]))


def test_answer_texts_resolve_to_ids():
    table = ids_by_text(["<a>", "x", "\ufffd", "\ufffd", "y"])
    assert table == {"<a>": [0], "x": [1], "\ufffd": [2, 3], "y": [4]}
    assert resolve_answer(["y", "x", "<a>"], table, 9) == ([4, 1, 0], 0)
    assert resolve_answer(["\ufffd", "z", "x"], table, 9) == ([2, 9, 1], 2)


def test_vocabulary_size_is_the_first_refused_id():
    asked = []

    async def below(n: int, token_id: int) -> bool:
        asked.append(token_id)
        return token_id < n

    for n in (1, 2, 3, 256, 257, 49152):
        assert asyncio.run(first_refused_id(lambda t, n=n: below(n, t), 2**31)) == n
    assert len(asked) < 200
    with pytest.raises(RuntimeError):
        asyncio.run(first_refused_id(lambda t: below(0, t), 2**31))
    with pytest.raises(RuntimeError):
        asyncio.run(first_refused_id(lambda t: below(10**6, t), 1000))


def test_parse_args(bm):
    ns = bm.parse_args([])
    assert (ns.num_conversations, ns.turns, ns.concurrency) == (64, 4, 64)
    assert (ns.system_len, ns.user_len, ns.output_len) == (1024, 128, 128)
    assert ns.token_range == (1000, 30000) and ns.tag is None
    assert bm.parse_args(["--token-range", " 3, 250"]).token_range == (3, 250)
    for bad in (["--token-range", "5,5"], ["--token-range", "1"], ["--turns", "0"],
                ["--system-len", "-1"]):  # fmt: skip
        with pytest.raises(SystemExit):
            bm.parse_args(bad)
