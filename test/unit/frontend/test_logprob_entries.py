"""Logprob accounting over a live server: one entry per counted token (chat and
completions, streamed or not, any n, however the choice ends), completions'
`logprobs: N` shape, continuous usage stats and vLLM's `prompt_logprobs`.

One fake server serves the whole module from its own thread and event loop; its
engine answers every request with REPLY (one token per output, or `seed` tokens
per output when the request has a seed). `ranked_position` replaces the logprobs
the fake sends so that a token's rank follows its id: an even id is the most
probable token at its position, an odd id ranks below every top-k token, so
completions' `top_logprobs` shows k entries for the one and k + 1 for the other.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from gyrfalcon.frontend.detokenizer import TokenTexts
from gyrfalcon.ipc.messages import GenerateRequest, PositionLogprobs, RequestOutput, TokenLogprob

from .frontend_fakes import (
    EOS_ID,
    PROMPT_LOGPROB,
    SAMPLED_LOGPROB,
    TEST_TIMEOUT_S,
    USER,
    LiveServer,
    Script,
    chat_prompt_ids,
    live_server,
    sse_events,
)

REPLY = "Hello world, this is a plain test."
REPLY_TOKENS = ["Hello", " world", ",", " this", " is", " a", " plain", " test", "."]
PROMPT = "Say hi there, friend"  # completions; token ids of both parities
OTHER_PROMPT = "Once upon a time"
ALT_WORDS = [" alpha", " beta", " gamma", " delta", " omega"]  # the top-k alternatives
RANK_GAP = 3  # an odd-id token ranks k + RANK_GAP (k = the top-k asked for)
TOP_N = 2  # logprobs / top_logprobs in the matrix
MAX_TOKENS = 50
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@dataclass(frozen=True)
class Ending:
    """One way a choice ends: request fields, and what the client must see."""

    finish_reason: str
    params: dict[str, Any]
    num_tokens: int  # counted completion tokens = logprob entries
    text: str  # the completion text shown (never a stop token's text)
    last_token: str  # the token string of the last logprob entry


ENDINGS = {
    "eos": Ending("stop", {}, len(REPLY_TOKENS) + 1, REPLY, "<|im_end|>"),
    # " plain" (index 6) is the stop token: counted, its text not shown
    "stop_token_id": Ending(
        "stop", {"stop_token_ids": None}, 7, "Hello world, this is a", " plain"
    ),
    # "is a" is completed by " a" (index 5)
    "stop_string": Ending("stop", {"stop": "is a"}, 6, "Hello world, this ", " a"),
    "length": Ending("length", {"max_tokens": 4}, 4, "Hello world, this", " this"),
}


def ranked_position(
    token_id: int, logprob: float, k: int, alts: list[int], prompt: bool = False
) -> PositionLogprobs:
    """What the engine reports at a position holding `token_id`: the token first
    among the top k if its id is even, else k tokens more probable than it."""
    if token_id % 2 == 0:
        others = [TokenLogprob(a, logprob - 1 - j) for j, a in enumerate(alts[: max(k - 1, 0)])]
        top, rank = [TokenLogprob(token_id, logprob), *others][:k], 1
    else:
        top = [TokenLogprob(a, logprob + (k - j) / 8) for j, a in enumerate(alts[:k])]
        rank = k + RANK_GAP
    return PositionLogprobs(token_id, logprob, top, rank if prompt else None)


def rank_logprobs(scheduler: Any, alts: list[int]) -> None:
    """Make the fake scheduler send `ranked_position`s (and prompt ranks)."""
    emit = scheduler._emit

    async def ranked(out: RequestOutput) -> None:
        sp = next(q.sampling for q in scheduler.requests if q.rid == out.rid)
        if out.logprobs is not None:
            out.logprobs = [
                ranked_position(p.token_id, p.logprob, sp.logprobs, alts) for p in out.logprobs
            ]
        if out.prompt_logprobs is not None:
            out.prompt_logprobs = [
                None
                if p is None
                else ranked_position(p.token_id, p.logprob, sp.prompt_logprobs, alts, True)
                for p in out.prompt_logprobs
            ]
        await emit(out)

    scheduler._emit = ranked


@dataclass
class Server:
    live: LiveServer
    client: httpx.Client
    texts: TokenTexts
    reply_ids: list[int]
    alts: list[int]
    ids_of: dict[str, list[int]]  # prompt text -> ids; "chat" -> the chat prompt

    def text_of(self, token_id: int) -> str:
        return self.texts.text_of(token_id)


@pytest.fixture(scope="module")
def server(tokenizer) -> Iterator[Server]:
    reply_ids = tokenizer.encode(REPLY)
    alts = [i for w in ALT_WORDS for i in tokenizer.encode(w)]
    ids_of = {p: tokenizer.encode(p) for p in (PROMPT, OTHER_PROMPT)}
    ids_of["chat"] = chat_prompt_ids(tokenizer, USER)
    assert len(alts) == len(ALT_WORDS)
    assert not set(alts) & set(reply_ids + [EOS_ID] + sum(ids_of.values(), []))

    def script(req: GenerateRequest) -> Script:
        return Script(reply_ids, chunk=max(1, req.sampling.seed or 1))

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="live-server", daemon=True)
    thread.start()
    serving = live_server(tokenizer, script)

    async def start() -> LiveServer:
        live = await serving.__aenter__()
        rank_logprobs(live.scheduler, alts)
        return live

    live = asyncio.run_coroutine_threadsafe(start(), loop).result(TEST_TIMEOUT_S)
    try:
        with httpx.Client(base_url=live.url, timeout=TEST_TIMEOUT_S) as client:
            yield Server(live, client, TokenTexts(tokenizer), reply_ids, alts, ids_of)
    finally:
        stop = serving.__aexit__(None, None, None)
        asyncio.run_coroutine_threadsafe(stop, loop).result(TEST_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(TEST_TIMEOUT_S)
        loop.close()


# ---------------------------------------------------------------- one shape for every reply


@dataclass
class Seen:
    """One choice as the client saw it (the stream's chunks joined)."""

    text: str = ""
    finish_reason: str | None = None
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[Any] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)  # completions only
    prompt_logprobs: list[Any] | None = None  # completions only

    def absorb(self, path: str, choice: dict[str, Any], streamed: bool) -> None:
        assert self.finish_reason is None, "a chunk after the choice's finish_reason"
        if path == CHAT:
            self.text += (choice["delta"] if streamed else choice["message"]).get("content") or ""
            entries = (choice.get("logprobs") or {}).get("content") or []
            self.tokens += [e["token"] for e in entries]
            self.token_logprobs += [e["logprob"] for e in entries]
            self.top_logprobs += [e["top_logprobs"] for e in entries]
        else:
            self.text += choice["text"]
            lp = choice.get("logprobs") or {}
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                getattr(self, key).extend(lp.get(key) or [])
            self.prompt_logprobs = choice.get("prompt_logprobs")
        self.finish_reason = choice.get("finish_reason")


@dataclass
class Reply:
    choices: list[Seen]
    usage: dict[str, int] | None
    body: dict[str, Any]  # the response (the last chunk when streamed)
    # streamed: per chunk with choices, its usage and the completion entries so far
    steps: list[tuple[dict[str, int] | None, int]] = field(default_factory=list)


def exchange(server: Server, path: str, body: dict[str, Any], echoed: int = 0) -> Reply:
    """POST `body`; `echoed` prompt entries per choice are not completion entries."""
    r = server.client.post(path, json=body)
    assert r.status_code == 200, r.text
    n = body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1)
    seen = [Seen() for _ in range(n)]
    if not body.get("stream"):
        data = r.json()
        assert [c["index"] for c in data["choices"]] == list(range(n))
        for c in data["choices"]:
            seen[c["index"]].absorb(path, c, streamed=False)
        return Reply(seen, data["usage"], data)
    events = sse_events(r.text)
    reply = Reply(seen, None, events[-1])
    for i, event in enumerate(events):
        if not event["choices"]:  # the usage chunk: the last one
            assert i == len(events) - 1 and event["usage"] is not None
            reply.usage = event["usage"]
            continue
        for c in event["choices"]:
            seen[c["index"]].absorb(path, c, streamed=True)
        entries = sum(max(0, len(s.tokens) - echoed) for s in seen)
        reply.steps.append((event.get("usage"), entries))
    return reply


def check_running_usage(reply: Reply, prompt_tokens: int) -> None:
    """Rule: every chunk with choices carries the usage so far."""
    assert reply.usage is not None
    usages = [u for u, _ in reply.steps]
    assert all(u is not None for u in usages), "a chunk with choices lacks usage"
    assert {u["prompt_tokens"] for u in usages} == {prompt_tokens}
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    running = [u["completion_tokens"] for u in usages]
    assert running == sorted(running)
    assert running == [entries for _, entries in reply.steps]  # the tokens streamed so far
    assert running[-1] == reply.usage["completion_tokens"]


def check_legacy_logprobs(
    server: Server, seen: Seen, k: int, prompt_ids: list[int], output_ids: list[int]
) -> None:
    """Completions' `logprobs: k` for the echoed prompt ids and the output ids."""
    ids = prompt_ids + output_ids
    assert seen.tokens == [server.text_of(t) for t in ids]
    assert len(seen.token_logprobs) == len(seen.top_logprobs) == len(seen.text_offset) == len(ids)
    assert seen.text_offset[0] == 0
    steps = [b - a for a, b in zip(seen.text_offset, seen.text_offset[1:])]
    assert steps == [len(t) for t in seen.tokens[:-1]]  # running, so non-decreasing
    for j, token_id in enumerate(ids):
        top = seen.top_logprobs[j]
        if prompt_ids and j == 0:
            assert seen.token_logprobs[j] is None and top is None
            continue
        logprob = PROMPT_LOGPROB if j < len(prompt_ids) else SAMPLED_LOGPROB
        assert seen.token_logprobs[j] == logprob
        sent = ranked_position(token_id, logprob, k, server.alts)
        want = {server.text_of(t.token_id): t.logprob for t in sent.top}
        want.setdefault(server.text_of(token_id), logprob)
        assert top == want
        # the top k, plus the chosen token when it is not among them (always for k = 0)
        assert len(top) == (k + 1 if token_id % 2 or k == 0 else k)


# ---------------------------------------------------------------- rule 1 (and 2): the matrix


def matrix_body(server: Server, path: str, ending: Ending, stream: bool, n: int, echo: bool):
    params = {"max_tokens": MAX_TOKENS, **ending.params}
    if "stop_token_ids" in params:
        params["stop_token_ids"] = [server.reply_ids[REPLY_TOKENS.index(" plain")]]
    body: dict[str, Any] = {"n": n, "stream": stream, **params}
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if path == CHAT:
        return {**body, "messages": USER, "logprobs": True, "top_logprobs": TOP_N}
    return {**body, "prompt": PROMPT, "logprobs": TOP_N, "echo": echo}


def test_reply_tokens(server, tokenizer):
    assert [tokenizer.decode([t]) for t in server.reply_ids] == REPLY_TOKENS


@pytest.mark.parametrize("ending_name", list(ENDINGS))
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    "path,echo",
    [(CHAT, False), (COMPLETIONS, False), (COMPLETIONS, True)],
    ids=["chat", "cmpl", "cmpl-echo"],
)
def test_one_logprob_entry_per_counted_token(server, path, echo, stream, n, ending_name):
    ending = ENDINGS[ending_name]
    prompt_ids = server.ids_of["chat" if path == CHAT else PROMPT]
    echoed = prompt_ids if echo else []
    reply = exchange(server, path, matrix_body(server, path, ending, stream, n, echo), len(echoed))
    output_ids = (server.reply_ids + [EOS_ID])[: ending.num_tokens]
    for seen in reply.choices:
        assert seen.finish_reason == ending.finish_reason
        assert seen.text == (PROMPT if echo else "") + ending.text
        assert len(seen.tokens) == len(seen.token_logprobs) == len(echoed) + ending.num_tokens
        assert seen.tokens[len(echoed) :] == [server.text_of(t) for t in output_ids]
        assert seen.tokens[-1] == ending.last_token
        assert seen.token_logprobs[len(echoed) :] == [SAMPLED_LOGPROB] * ending.num_tokens
        if path == CHAT:
            assert all(len(top) == TOP_N for top in seen.top_logprobs)
        else:
            check_legacy_logprobs(server, seen, TOP_N, echoed, output_ids)
    assert reply.usage is not None
    entries = sum(len(s.tokens) - len(echoed) for s in reply.choices)
    assert reply.usage["completion_tokens"] == entries == n * ending.num_tokens
    assert reply.usage["prompt_tokens"] == len(prompt_ids)
    if stream:
        check_running_usage(reply, len(prompt_ids))


# ---------------------------------------------------------------- rule 1: what the engine reported


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stop_string_ends_at_the_completing_token_of_a_multi_token_output(server, path):
    """With several tokens per output (speculative decoding), the choice ends at the
    token that completes the stop string, as with one token per output: the tokens
    after it in that output have no entries and are not counted."""
    body = {"n": 2, "seed": 3, "stop": "is a", "max_tokens": MAX_TOKENS, "logprobs": True}
    body.update({"messages": USER} if path == CHAT else {"prompt": PROMPT, "logprobs": 0})
    reply = exchange(server, path, body)
    completed_at = REPLY_TOKENS.index(" a") + 1
    for seen in reply.choices:  # 3 and 4 tokens per output: the choice's seed
        assert (seen.text, seen.finish_reason) == ("Hello world, this ", "stop")
        assert seen.tokens == [server.text_of(t) for t in server.reply_ids[:completed_at]]
    assert reply.usage["completion_tokens"] == 2 * completed_at


# ---------------------------------------------------------------- rule 2: completions' logprobs: N


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("k", [0, 1, 5])
def test_completion_top_logprobs_hold_top_k_and_the_sampled_token(server, k, stream):
    body = {"prompt": PROMPT, "echo": True, "logprobs": k, "max_tokens": MAX_TOKENS}
    prompt_ids = server.ids_of[PROMPT]
    reply = exchange(server, COMPLETIONS, {**body, "stream": stream}, len(prompt_ids))
    (seen,) = reply.choices
    check_legacy_logprobs(server, seen, k, prompt_ids, server.reply_ids + [EOS_ID])
    if k == 0:
        assert all(top is None or len(top) == 1 for top in seen.top_logprobs)
    assert server.live.scheduler.requests[-1].sampling.prompt_logprobs == k


# ---------------------------------------------------------------- rule 3: continuous usage


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(
    "options,per_chunk,final",
    [
        ({"include_usage": True, "continuous_usage_stats": True}, True, True),
        ({"include_usage": True}, False, True),
        ({"include_usage": True, "continuous_usage_stats": False}, False, True),
        ({"continuous_usage_stats": True}, False, False),  # vLLM: needs include_usage
    ],
)
def test_stream_usage_options(server, path, options, per_chunk, final):
    body = {"stream": True, "stream_options": options, "n": 2, "max_tokens": MAX_TOKENS}
    body.update(
        {"messages": USER, "logprobs": True} if path == CHAT else {"prompt": PROMPT, "logprobs": 0}
    )
    reply = exchange(server, path, body)
    prompt_tokens = len(server.ids_of["chat" if path == CHAT else PROMPT])
    if per_chunk:
        check_running_usage(reply, prompt_tokens)
    else:
        assert all(u is None for u, _ in reply.steps)
    if final:
        completion = 2 * (len(REPLY_TOKENS) + 1)
        assert reply.usage == {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        }
    else:
        assert reply.usage is None and reply.body["choices"]


# ---------------------------------------------------------------- rule 4: prompt_logprobs


def check_prompt_logprobs(
    server: Server, got: Any, prompt_ids: list[int], k: int, sent_k: int | None = None
) -> None:
    """vLLM's shape: None first, then {token id: {logprob, rank, decoded_token}}
    holding the top k (ranks 1..k) and the prompt's token with its rank; the
    engine was asked for the top `sent_k` (default k)."""
    sent_k = k if sent_k is None else sent_k
    assert isinstance(got, list) and len(got) == len(prompt_ids)
    assert got[0] is None
    for token_id, entry in zip(prompt_ids[1:], got[1:]):
        sent = ranked_position(token_id, PROMPT_LOGPROB, sent_k, server.alts, prompt=True)
        want = {
            str(t.token_id): {
                "logprob": t.logprob,
                "rank": r,
                "decoded_token": server.text_of(t.token_id),
            }
            for r, t in enumerate(sent.top[:k], start=1)
        }
        want.setdefault(
            str(token_id),
            {
                "logprob": PROMPT_LOGPROB,
                "rank": sent.rank,
                "decoded_token": server.text_of(token_id),
            },
        )
        assert entry == want
        assert entry[str(token_id)]["rank"] == (1 if token_id % 2 == 0 else sent_k + RANK_GAP)
        assert len(entry) == (k + 1 if token_id % 2 or k == 0 else k)


@pytest.mark.parametrize("k", [0, 3])
def test_completion_prompt_logprobs_per_choice(server, k):
    prompts = [PROMPT, OTHER_PROMPT]
    body = {"prompt": prompts, "n": 2, "prompt_logprobs": k, "max_tokens": 2}
    reply = exchange(server, COMPLETIONS, body)
    for i, seen in enumerate(reply.choices):  # index = prompt index * n + choice
        check_prompt_logprobs(server, seen.prompt_logprobs, server.ids_of[prompts[i // 2]], k)
        assert seen.tokens == []  # `logprobs` was not asked for
    assert "prompt_logprobs" not in reply.body


def test_completion_prompt_logprobs_with_echo_logprobs(server):
    """The engine is asked for max(logprobs, prompt_logprobs); each field shows its own k."""
    body = {"prompt": PROMPT, "echo": True, "logprobs": 4, "prompt_logprobs": 1, "max_tokens": 3}
    prompt_ids = server.ids_of[PROMPT]
    (seen,) = exchange(server, COMPLETIONS, body, len(prompt_ids)).choices
    assert server.live.scheduler.requests[-1].sampling.prompt_logprobs == 4
    check_prompt_logprobs(server, seen.prompt_logprobs, prompt_ids, 1, sent_k=4)
    check_legacy_logprobs(server, seen, 4, prompt_ids, server.reply_ids[:3])


def test_chat_prompt_logprobs_at_the_top_level(server):
    body = {"messages": USER, "n": 2, "prompt_logprobs": 2, "max_tokens": 2}
    reply = exchange(server, CHAT, body)
    check_prompt_logprobs(server, reply.body["prompt_logprobs"], server.ids_of["chat"], 2)
    assert all("prompt_logprobs" not in c for c in reply.body["choices"])
    plain = exchange(server, CHAT, {"messages": USER, "max_tokens": 2})
    assert plain.body["prompt_logprobs"] is None


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_prompt_logprobs_refused_when_streaming(server, path):
    body = {"stream": True, "prompt_logprobs": 1}
    body.update({"messages": USER} if path == CHAT else {"prompt": PROMPT})
    before = len(server.live.scheduler.requests)
    r = server.client.post(path, json=body)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt_logprobs"
    assert len(server.live.scheduler.requests) == before
