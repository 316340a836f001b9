"""vLLM's `prompt_logprobs` over a live fake server (`logprob_server.serve`): the
shape per choice for completions and at the top level for chat, beside completions'
echoed `logprobs`, and refused when streaming."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .frontend_fakes import PROMPT_LOGPROB, USER
from .logprob_server import (
    CHAT,
    COMPLETIONS,
    OTHER_PROMPT,
    PROMPT,
    RANK_GAP,
    Server,
    check_legacy_logprobs,
    exchange,
    ranked_position,
    serve,
)


@pytest.fixture(scope="module")
def server(tokenizer) -> Iterator[Server]:
    yield from serve(tokenizer)


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
