"""Streaming client and end-to-end run of the load generator against a fake server."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from fake_http import ThreadedApp

from gyrfalcon.bench.client import SSEDecoder, build_payload
from gyrfalcon.bench.datasets import SampleRequest
from gyrfalcon.bench.serving import main

TOKENS = ["Hel", "lo", " wor", "ld"]
FIRST_DELAY = 0.05  # seconds before the first text chunk
GAP = 0.02  # seconds between text chunks


class FakeServer(ThreadedApp):
    """OpenAI-shaped streaming server on a free 127.0.0.1 port, in its own thread."""

    def __init__(self, send_usage: bool = True) -> None:
        self.send_usage = send_usage
        self.requests: list[dict[str, Any]] = []
        self.seen: set[str] = set()  # prompts served before: reported cached, as a prefix cache
        super().__init__()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        chat = request.path.endswith("/chat/completions")
        prompt = body.get("prompt") or body["messages"][0]["content"]
        if prompt == "fail":
            return web.Response(status=500, text="model exploded")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def event(obj: Any) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        def choice(text: str, finish: str | None = None) -> dict[str, Any]:
            c: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                c["delta"] = {"content": text}
            else:
                c["text"] = text
            return c

        if chat:  # role-only first chunk: carries no text, must not count as TTFT
            await event({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        await resp.write(b": keep-alive comment\n\n")
        await asyncio.sleep(FIRST_DELAY)
        n = min(body["max_tokens"], len(TOKENS))
        for i, tok in enumerate(TOKENS[:n]):
            if i:
                await asyncio.sleep(GAP)
            raw = f"data: {json.dumps({'choices': [choice(tok)]})}\r\n\r\n".encode()
            await resp.write(raw[:7])  # split an event across network writes
            await resp.write(raw[7:])
        await event({"choices": [choice("", "length")]})
        if self.send_usage:
            plen = len(prompt) if isinstance(prompt, list) else len(prompt.split())
            cached = plen if json.dumps(prompt) in self.seen else 0
            usage = {"prompt_tokens": plen, "completion_tokens": n}
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
            await event({"choices": [], "usage": usage})
        self.seen.add(json.dumps(prompt))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._stream)
        app.router.add_post("/v1/chat/completions", self._stream)


@pytest.fixture
def server() -> Iterator[FakeServer]:
    with FakeServer() as s:
        yield s


def test_sse_decoder_handles_splits_crlf_comments_and_multiline() -> None:
    dec = SSEDecoder()
    assert dec.feed(b'data: {"a"') == []
    assert dec.feed(b": 1}\r\n\r\n: ping\n\nevent: x\ndata: one\ndata:two\n") == ['{"a": 1}']
    assert dec.feed(b"\ndata: [DONE]") == ["one\ntwo"]
    assert dec.flush() == ["[DONE]"]
    assert dec.flush() == []


def test_build_payload_shapes() -> None:
    ids = SampleRequest(prompt=[1, 2, 3], prompt_len=3, output_len=9)
    p = build_payload("completions", "m", ids, ignore_eos=True, extra_body={"top_k": 5})
    assert p == {
        "model": "m",
        "temperature": 0.0,
        "prompt": [1, 2, 3],
        "max_tokens": 9,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "top_k": 5,
    }
    text = SampleRequest(prompt="hi", prompt_len=None, output_len=2)
    chat = build_payload("chat", "m", text, extra_body={"temperature": 0.7})
    assert chat["temperature"] == 0.7  # extra_body wins
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "ignore_eos" not in chat
    with pytest.raises(ValueError):
        build_payload("chat", "m", ids)


def test_end_to_end_completions_random_ids(server: FakeServer, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    rc = main(
        [
            "--port",
            str(server.port),
            "--num-prompts",
            "4",
            "--random-input-len",
            "8",
            "--random-output-len",
            "4",
            "--max-concurrency",
            "2",
            "--ignore-eos",
            "--disable-tqdm",
            "--output-json",
            str(out),
            "--plot",
            str(tmp_path / "run.png"),
            "--seed",
            "3",
        ]
    )
    assert rc == 0
    assert (tmp_path / "run.png").read_bytes()[:4] == b"\x89PNG"
    assert len(server.requests) == 5  # one warmup + four timed
    for body in server.requests:
        assert body["model"] == "fake-model" and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["max_tokens"] == 4
        assert len(body["prompt"]) == 8 and all(isinstance(t, int) for t in body["prompt"])

    report = json.loads(out.read_text())
    assert report["model"] == "fake-model" and report["endpoint"] == "completions"
    assert report["args"]["request_rate"] == "inf" and report["args"]["num_prompts"] == 4
    s = report["summary"]
    assert s["completed"] == 4 and s["failed"] == 0
    assert s["total_input_tokens"] == 32 and s["total_output_tokens"] == 16
    assert s["output_throughput"] == pytest.approx(16 / s["duration_s"])
    per = report["per_request"]
    assert per["output_tokens"] == [4, 4, 4, 4] and per["success"] == [True] * 4
    for ttft, e2el, itl in zip(per["ttft_ms"], per["e2el_ms"], per["itl_ms"]):
        assert ttft >= 0.8 * FIRST_DELAY * 1000
        assert len(itl) == 3 and all(g >= 0.8 * GAP * 1000 for g in itl)
        assert e2el >= ttft + sum(itl) - 1e-6
    assert s["mean_tpot_ms"] >= 0.8 * GAP * 1000
    assert s["p99_itl_ms"] is not None and s["median_e2el_ms"] is not None
    # the warm-up's prompt is none of the timed ones: a prefix cache finds none computed
    warm, timed = server.requests[0]["prompt"], [b["prompt"] for b in server.requests[1:]]
    assert warm not in timed
    assert s["total_cached_input_tokens"] == 0 and per["cached_tokens"] == [0] * 4


def test_a_run_repeating_prompts_says_how_many_were_cached(server: FakeServer, tmp_path) -> None:
    """The same seed twice sends the same prompts: the second run's figures are not cold
    ones, and its report says so (a burst of a smaller concurrency's prompts again)."""
    args = ["--port", str(server.port), "--num-prompts", "3", "--random-input-len", "8",
            "--random-output-len", "2", "--disable-tqdm", "--seed", "5"]  # fmt: skip
    got = []
    for run in ("first", "again"):
        assert main([*args, "--output-json", str(tmp_path / f"{run}.json")]) == 0
        got.append(json.loads((tmp_path / f"{run}.json").read_text()))
    assert [r["summary"]["total_cached_input_tokens"] for r in got] == [0, 24]
    assert got[1]["per_request"]["cached_tokens"] == [8, 8, 8]


def test_end_to_end_chat_jsonl_without_usage_and_a_failure(tmp_path: Path) -> None:
    data = tmp_path / "q.jsonl"
    data.write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"turns": ["one two three", "follow-up"]},
                {"prompt": "fail"},
                {"prompt": "a b", "max_tokens": 2},
            ]
        )
        + "\n"
    )
    out = tmp_path / "chat.json"
    with FakeServer(send_usage=False) as srv:
        rc = main(
            [
                "--base-url",
                f"http://127.0.0.1:{srv.port}/",
                "--endpoint",
                "chat",
                "--model",
                "given",
                "--dataset",
                "jsonl",
                "--dataset-path",
                str(data),
                "--jsonl-output-len",
                "3",
                "--warmup-requests",
                "0",
                "--request-rate",
                "50",
                "--disable-tqdm",
                "--output-json",
                str(out),
                "--percentiles",
                "90,99",
            ]
        )
    assert rc == 0
    assert [b["model"] for b in srv.requests] == ["given"] * 3
    report = json.loads(out.read_text())
    s, per = report["summary"], report["per_request"]
    assert s["completed"] == 2 and s["failed"] == 1
    assert per["success"] == [True, False, True]
    assert "HTTP 500" in per["error"][1] and "model exploded" in per["error"][1]
    assert per["output_tokens"] == [3, None, 2]  # counted from chunks: no usage sent
    assert s["total_input_tokens"] == 0  # unknown without usage or tokenizer
    assert s["total_cached_input_tokens"] is None  # nor whether any was cached
    assert "p90_ttft_ms" in s and "p99_ttft_ms" in s
    assert per["ttft_ms"][0] >= 0.8 * FIRST_DELAY * 1000  # role chunk ignored


def test_unreachable_server_fails_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    start = time.perf_counter()
    rc = main(["--port", str(port), "--num-prompts", "2", "--disable-tqdm"])
    assert rc == 1 and time.perf_counter() - start < 5
    assert "error" in capsys.readouterr().err


def test_argument_errors() -> None:
    with pytest.raises(SystemExit):
        main(["--endpoint", "chat", "--random-prompt-format", "ids"])
    with pytest.raises(SystemExit):
        main(["--request-rate", "0"])
    assert main(["--dataset", "jsonl"]) == 2  # no --dataset-path
    assert main(["--endpoint", "chat"]) == 2  # text prompts but no tokenizer


@pytest.mark.parametrize("num_prompts, warm", [(2, "c d"), (None, "a b")])
def test_a_jsonl_warm_up_takes_a_line_past_the_run_when_there_is_one(
    server: FakeServer, tmp_path: Path, num_prompts, warm
) -> None:
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["a b", "b c", "c d"]))
    sized = [] if num_prompts is None else ["--num-prompts", str(num_prompts)]
    args = ["--port", str(server.port), "--dataset", "jsonl", "--dataset-path", str(data),
            "--jsonl-output-len", "2", "--disable-tqdm", *sized]  # fmt: skip
    assert main(args) == 0
    sent = [b["prompt"] for b in server.requests]
    assert sent[0] == warm and sorted(sent[1:]) == ["a b", "b c", "c d"][: num_prompts or 3]
