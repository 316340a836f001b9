"""Random valid requests on the real engine, both endpoints, streamed or not: each
draws its sampling parameters (temperature, top_p/top_k/min_p, penalties, n, seed,
stop strings and ids, logit_bias, min_tokens, ignore_eos, logprobs, echo) and must
come back whole: n choices, a finish reason each, as many tokens as max_tokens and
min_tokens allow, usage that counts them, no stop string left in the text. The client
fixture then checks that every page came back."""

from __future__ import annotations

import random

import httpx
import pytest
from server_util import sse_events

WORDS = ["the", " cat", " sat", ".", "\n", " on", "!", " mat", "a", ",", " 1", " 2"]
VOCAB = 49152  # SmolLM2's
REQUESTS = 40


def _params(rng: random.Random, model: str, chat: bool) -> dict:
    text = "".join(rng.choice(WORDS) for _ in range(rng.randint(1, 24)))
    p: dict = {"model": model, "max_tokens": rng.randint(1, 10), "n": rng.choice([1, 1, 2])}
    p["temperature"] = rng.choice([0.0, 0.0, 0.7, 1.5])
    optional = {
        "top_p": lambda: rng.choice([0.05, 0.5, 1.0]),
        "top_k": lambda: rng.choice([-1, 1, 5]),
        "min_p": lambda: rng.choice([0.0, 0.2, 1.0]),
        "presence_penalty": lambda: rng.uniform(-2, 2),
        "frequency_penalty": lambda: rng.uniform(-2, 2),
        "repetition_penalty": lambda: rng.choice([0.8, 1.3]),
        "seed": lambda: rng.randint(0, 2**31),
        "stop": lambda: rng.sample(WORDS, rng.randint(1, 3)),
        "stop_token_ids": lambda: [rng.randrange(VOCAB) for _ in range(2)],
        "logit_bias": lambda: {str(rng.randrange(VOCAB)): rng.uniform(-100, 100)},
        "min_tokens": lambda: rng.randint(0, p["max_tokens"]),
        "ignore_eos": lambda: True,
    }
    for key, draw in optional.items():
        if rng.random() < 0.25:
            p[key] = draw()
    p["stream"] = rng.random() < 0.4
    if p["stream"] and rng.random() < 0.5:
        p["stream_options"] = {"include_usage": True}
    if chat:  # logprobs on, so that every choice's tokens are counted
        p.update(messages=[{"role": "user", "content": text}], logprobs=True)
        p["top_logprobs"] = rng.randint(0, 3)
    else:
        p.update(prompt=text, logprobs=rng.randint(0, 3))
        p["echo"] = not p["stream"] and rng.random() < 0.2
    return p


def _choices(p: dict, r: httpx.Response, chat: bool) -> tuple[list[dict], dict | None]:
    """Each choice's text, finish reason and token count, and the usage."""
    if not p["stream"]:
        body = r.json()
        out = []
        for c in sorted(body["choices"], key=lambda c: c["index"]):
            lp = c["logprobs"]
            text = c["message"]["content"] if chat else c["text"]
            ntok = len(lp["content"] or []) if chat else len(lp["tokens"])
            if p.get("echo"):  # the prompt's tokens and text come first
                ntok -= body["usage"]["prompt_tokens"]
                text = text[len(p["prompt"]) :]
            out.append({"text": text or "", "finish": c["finish_reason"], "tokens": ntok})
        return out, body["usage"]
    texts: dict[int, str] = {}
    tokens: dict[int, int] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in sse_events(r.text):
        assert "error" not in chunk, chunk
        if chunk.get("usage") and not chunk["choices"]:
            usage = chunk["usage"]
        for c in chunk["choices"]:
            i = c["index"]
            piece = c["delta"].get("content") if chat else c["text"]
            texts[i] = texts.get(i, "") + (piece or "")
            lp = c.get("logprobs")
            if lp:
                tokens[i] = tokens.get(i, 0) + len((lp["content"] or []) if chat else lp["tokens"])
            if c.get("finish_reason"):
                finish[i] = c["finish_reason"]
    assert sorted(finish) == list(range(p["n"])), finish
    n = range(p["n"])
    return [
        {"text": texts.get(i, ""), "finish": finish[i], "tokens": tokens.get(i, 0)} for i in n
    ], usage


@pytest.mark.parametrize("seed", [0, 1])
def test_random_requests_come_back_whole(client, server, model_name, seed):
    rng = random.Random(seed)
    for _ in range(REQUESTS // 2):
        chat = rng.random() < 0.5
        p = _params(rng, model_name, chat)
        path = "/v1/chat/completions" if chat else "/v1/completions"
        r = httpx.post(server.base_url + path, json=p, timeout=120)
        assert r.status_code == 200, (p, r.text[:500])
        choices, usage = _choices(p, r, chat)
        assert len(choices) == p["n"], p
        floor = min(p.get("min_tokens", 0), p["max_tokens"])
        for c in choices:
            assert c["finish"] in ("stop", "length"), (p, c)
            assert floor <= c["tokens"] <= p["max_tokens"], (p, c)
            if c["finish"] == "length":
                assert c["tokens"] == p["max_tokens"], (p, c)
            if not p.get("min_tokens"):  # the output ends before the first stop string
                # NOTE: under min_tokens one may stand in the text before it ends
                assert not any(s in c["text"] for s in p.get("stop", [])), (p, c)
        if usage is not None:
            assert usage["completion_tokens"] == sum(c["tokens"] for c in choices), (p, usage)
        elif not p["stream"] or p.get("stream_options"):
            pytest.fail(f"no usage: {p}")
