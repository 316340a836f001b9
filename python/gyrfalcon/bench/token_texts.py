"""The server's text of every token id, and answers' ids read back from their streamed
texts (bench_multiturn.py): the API streams text, not ids, and one echoed completion
with logprobs names the text of each id it was sent."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import aiohttp

from gyrfalcon.bench.client import ERROR_BODY_CHARS


async def first_refused_id(accepted: Callable[[int], Awaitable[bool]], limit: int) -> int:
    """The smallest id `accepted` refuses, for an `accepted` true exactly below it
    (doubling, then bisecting). RuntimeError if 0 is refused or none below `limit` is."""
    if not await accepted(0):
        raise RuntimeError("token id 0 is refused")
    low, high = 0, 1  # low is accepted; high is unknown until the loop ends
    while await accepted(high):
        low, high = high, high * 2
        if high > limit:
            raise RuntimeError(f"every token id up to {low} is accepted")
    while high - low > 1:
        mid = (low + high) // 2
        if await accepted(mid):
            low = mid
        else:
            high = mid
    return high


async def vocab_size(session: aiohttp.ClientSession, base_url: str, model: str, limit: int) -> int:
    """How many token ids the server takes: the first id POST /detokenize refuses
    (400: outside the vocabulary; RuntimeError if every id up to `limit` is taken).
    Costs no engine work."""

    async def accepted(token_id: int) -> bool:
        body = {"model": model, "tokens": [token_id]}
        async with session.post(f"{base_url}/detokenize", json=body) as response:
            if response.status in (200, 400):
                return response.status == 200
            text = (await response.text())[:ERROR_BODY_CHARS]
            raise RuntimeError(f"/detokenize: HTTP {response.status}: {text}")

    return await first_refused_id(accepted, limit)


def probe_payload(model: str, ids: list[int]) -> dict[str, Any]:
    """An echoed completion of `ids`: its logprobs name the text of each of them."""
    return {"model": model, "prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 1,
            "temperature": 0.0}  # fmt: skip


async def read_token_texts(
    session: aiohttp.ClientSession, url: str, model: str, vocab: int, chunk: int, concurrency: int
) -> list[str]:
    """The server's text of each id below `vocab`, as its logprobs show that token."""
    limiter = asyncio.Semaphore(concurrency)

    async def one(low: int) -> list[str]:
        ids = list(range(low, min(low + chunk, vocab)))
        async with limiter, session.post(url, json=probe_payload(model, ids)) as response:
            if response.status != 200:
                text = (await response.text())[:ERROR_BODY_CHARS]
                raise RuntimeError(f"reading token texts: HTTP {response.status}: {text}")
            body = await response.json()
        tokens = body["choices"][0]["logprobs"]["tokens"]
        if len(tokens) <= len(ids):
            raise RuntimeError(f"an echo of {len(ids)} ids came back with {len(tokens)} tokens")
        return tokens[: len(ids)]

    parts = await asyncio.gather(*(one(low) for low in range(0, vocab, chunk)))
    return [text for part in parts for text in part]


def ids_by_text(texts: Sequence[str]) -> dict[str, list[int]]:
    """text -> the ids that read so, ascending (texts[i] is the text of id i)."""
    table: dict[str, list[int]] = {}
    for token_id, text in enumerate(texts):
        table.setdefault(text, []).append(token_id)
    return table


def resolve_answer(
    texts: Sequence[str], table: dict[str, list[int]], filler: int
) -> tuple[list[int], int]:
    """(the ids of an answer's token texts, how many of them are not exactly known): a
    text several ids share gives the smallest of them, an unknown text `filler`."""
    ids: list[int] = []
    inexact = 0
    for text in texts:
        candidates = table.get(text)
        ids.append(candidates[0] if candidates else filler)
        inexact += candidates is None or len(candidates) > 1
    return ids, inexact
