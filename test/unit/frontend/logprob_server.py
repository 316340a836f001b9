"""The fake server of the logprob-accounting tests (test_logprob_entries.py,
test_prompt_logprob_entries.py) and what the client sees of its replies.

Its engine answers every request with REPLY (one token per output, or `seed` tokens
per output when the request has a seed). `ranked_position` replaces the logprobs the
fake sends so that a token's rank follows its id: an even id is the most probable
token at its position, an odd id ranks below every top-k token, so completions'
`top_logprobs` shows k entries for the one and k + 1 for the other.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

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


def serve(tokenizer) -> Iterator[Server]:
    """The module's fake server (its own thread and event loop), until closed."""
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
