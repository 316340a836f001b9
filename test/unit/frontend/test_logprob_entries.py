"""Logprob accounting over a live server: one entry per counted token (chat and
completions, streamed or not, any n, however the choice ends), completions'
`logprobs: N` shape, continuous usage stats and vLLM's `prompt_logprobs`.

One fake server (`logprob_server.serve`) serves the whole module; vLLM's
`prompt_logprobs` are in test_prompt_logprob_entries.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from .frontend_fakes import EOS_ID, SAMPLED_LOGPROB, USER
from .logprob_server import (
    CHAT,
    COMPLETIONS,
    ENDINGS,
    MAX_TOKENS,
    PROMPT,
    REPLY_TOKENS,
    TOP_N,
    Ending,
    Server,
    check_legacy_logprobs,
    check_running_usage,
    exchange,
    serve,
)


@pytest.fixture(scope="module")
def server(tokenizer) -> Iterator[Server]:
    yield from serve(tokenizer)


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
