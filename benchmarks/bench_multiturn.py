#!/usr/bin/env python3
"""Multi-turn chats against a running server: what prefix caching buys.

--num-conversations conversations of --turns turns share one system prompt of
--system-len random token ids. Turn k of a conversation sends the token-id prompt

    system + (user_1 + answer_1) + ... + (user_{k-1} + answer_{k-1}) + user_k

as a streamed greedy request to POST /v1/completions, with --user-len fresh random
ids per turn and the ids the server generated for the earlier answers, so a server
that caches prefixes finds the system prompt and every earlier turn cached. Every
answer is exactly --output-len tokens (max_tokens, ignore_eos). A conversation's
turns run back to back; at most --concurrency conversations are in flight. Random
ids come from --token-range [LO, HI) (numpy, --seed): no tokenizer is needed.

Answer ids: the API streams text, not ids. Each request asks for `logprobs: 0`,
which streams one token string per generated token (the server's text of that id).
Before timing starts the benchmark reads the server's text of every id of its
vocabulary once (echoed token-id prompts with logprobs, --probe-chunk ids each; the
vocabulary size is the first id /detokenize refuses) and maps the strings back to
ids (untimed; it also warms the server up). That is exact for every id whose text
no other id shares: every id of the synthetic tokenizers, nearly all of a real
vocabulary (byte pieces that are not whole UTF-8 characters read as the replacement
character: 312 of SmolLM2's 49,152 ids share a text). A shared text
resolves to its smallest id, a text no id has (none should) to LO, and either is
counted in `answer_tokens_inexact`: the next turn's prompt then differs from what
the server generated from that token on, and only the pages before it can come from
the cache. Logprobs cost the server a log-softmax per generated token, in every run
alike.

Reported: requests, duration, output tokens/s (all output tokens / the run's wall
time), median and p90 TTFT (request sent -> first streamed token) overall and per
turn, median TPOT ((e2e - ttft) / (output tokens - 1)), prompt tokens and the cached
ones among them (usage.prompt_tokens_details.cached_tokens; a server without prefix
caching reports none). Run it once against each of two servers, one started with
--disable-prefix-caching:

    gyrfalcon serve MODEL --port 8000
    python benchmarks/bench_multiturn.py --port 8000 --tag cache \\
        --device-kind nvidia-h100-x1 --output-json multiturn_cache.json
    gyrfalcon serve MODEL --port 8000 --disable-prefix-caching
    python benchmarks/bench_multiturn.py --port 8000 --tag nocache \\
        --device-kind nvidia-h100-x1 --output-json multiturn_nocache.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

try:
    import gyrfalcon  # noqa: F401
except ImportError:  # running from a checkout without an installed package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from gyrfalcon.bench import report_json
from gyrfalcon.bench.client import (
    DONE_SENTINEL,
    ENDPOINT_PATHS,
    ERROR_BODY_CHARS,
    build_payload,
    post_stream,
)
from gyrfalcon.bench.datasets import SampleRequest
from gyrfalcon.bench.multiturn_report import (
    TurnResult,
    format_report,
    request_row,
    summarize_turns,
)
from gyrfalcon.bench.provenance import git_commit
from gyrfalcon.bench.serving import base_url_of
from gyrfalcon.bench.serving_args import DEFAULTS as SERVE_DEFAULTS
from gyrfalcon.bench.token_texts import (
    ids_by_text,
    read_token_texts,
    resolve_answer,
    vocab_size,
)


@dataclass(frozen=True)
class MultiTurnDefaults:
    """Every default of the benchmark, in one place."""

    num_conversations: int = 64
    turns: int = 4
    concurrency: int = 64
    system_len: int = 1024
    user_len: int = 128
    output_len: int = 128
    seed: int = 0
    token_range: str = "%d,%d" % SERVE_DEFAULTS.random_token_range
    probe_chunk: int = 1024  # vocabulary ids per echoed probe request
    probe_concurrency: int = 4
    request_timeout_s: float = 3600.0
    max_vocab: int = 2**31  # the vocabulary search gives up past this id
    shown_errors: int = 5


DEFAULTS = MultiTurnDefaults()


def parse_token_range(text: str) -> tuple[int, int]:
    """'1000,30000' -> (1000, 30000); ValueError unless 0 <= LO < HI."""
    parts = text.split(",")
    if len(parts) != 2:
        raise ValueError(f"a token range is LO,HI; got {text!r}")
    low, high = int(parts[0]), int(parts[1])
    if not 0 <= low < high:
        raise ValueError(f"a token range needs 0 <= LO < HI; got {text!r}")
    return low, high


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    d = DEFAULTS
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        allow_abbrev=False,
    )
    p.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    p.add_argument("--host", default=SERVE_DEFAULTS.host)
    p.add_argument("--port", type=int, default=SERVE_DEFAULTS.port)
    p.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    p.add_argument("--num-conversations", type=int, default=d.num_conversations)
    p.add_argument("--turns", type=int, default=d.turns, help="requests per conversation")
    p.add_argument("--concurrency", type=int, default=d.concurrency,
                   help="conversations in flight at once")  # fmt: skip
    p.add_argument("--system-len", type=int, default=d.system_len,
                   help="tokens of the one system prompt all conversations share")  # fmt: skip
    p.add_argument("--user-len", type=int, default=d.user_len, help="new tokens per turn")
    p.add_argument("--output-len", type=int, default=d.output_len, help="tokens per answer")
    p.add_argument("--token-range", type=parse_token_range, default=d.token_range,
                   metavar="LO,HI", help="random ids are drawn from [LO, HI)")  # fmt: skip
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--probe-chunk", type=int, default=d.probe_chunk,
                   help="vocabulary ids per request when reading the token texts")  # fmt: skip
    p.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    p.add_argument("--output-json", default=None, help="write args, summary and per-request data")
    p.add_argument("--device-kind", default="unknown", help="machine label, in the JSON")
    p.add_argument("--tag", default=None, help="run label, in the JSON (e.g. cache, nocache)")
    ns = p.parse_args(argv)  # NOTE: the string default goes through `type` too
    positive = ("num_conversations", "turns", "concurrency", "user_len", "output_len",
                "probe_chunk")  # fmt: skip
    for name in positive:
        if getattr(ns, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if ns.system_len < 0:
        p.error("--system-len must be >= 0")
    return ns


# ---------------------------------------------------------------- the workload


@dataclass(frozen=True)
class Workload:
    system: list[int]  # shared by every conversation
    users: list[list[list[int]]]  # [conversation][turn] -> that turn's user ids


def make_workload(
    num_conversations: int,
    turns: int,
    system_len: int,
    user_len: int,
    token_range: tuple[int, int],
    seed: int,
) -> Workload:
    """One system prompt, and fresh user ids for every turn of every conversation."""
    rng = np.random.default_rng(seed)
    low, high = token_range
    system = rng.integers(low, high, size=system_len).tolist()
    users = rng.integers(low, high, size=(num_conversations, turns, user_len)).tolist()
    return Workload(system, users)


def turn_prompt(
    system: Sequence[int], users: Sequence[Sequence[int]], answers: Sequence[Sequence[int]]
) -> list[int]:
    """system + (user_1 + answer_1) + ... + user_k: the prompt of turn k = len(users),
    given the answers of the turns before it."""
    if len(users) != len(answers) + 1:
        raise ValueError(f"turn {len(users)} follows {len(users) - 1} answers, not {len(answers)}")
    ids = list(system)
    for user, answer in zip(users, answers):
        ids += [*user, *answer]
    return ids + list(users[-1])


def last_prompt_len(system_len: int, user_len: int, output_len: int, turns: int) -> int:
    """Tokens in the prompt of a conversation's last turn."""
    return system_len + turns * user_len + (turns - 1) * output_len


def turn_payload(model: str, prompt: list[int], output_len: int) -> dict[str, Any]:
    """The bench client's greedy streamed body, EOS ignored, with one logprobs entry
    (its token's text) per generated token."""
    sample = SampleRequest(prompt=prompt, prompt_len=len(prompt), output_len=output_len)
    return build_payload("completions", model, sample, True, {"logprobs": 0})


# ---------------------------------------------------------------- one turn


class TurnStream:
    """Folds the SSE payloads of one streamed completion into a TurnResult: TTFT at the
    first chunk carrying a token (its text or its logprobs entry)."""

    def __init__(self, result: TurnResult, start: float) -> None:
        self.result, self.start, self.last = result, start, start
        self.chunks = 0
        self.usage: dict[str, Any] = {}

    def feed(self, data: str, now: float) -> bool:
        """Process one event payload; True at the end of the stream."""
        if data.strip() == DONE_SENTINEL:
            return True
        event = json.loads(data)
        if event.get("error"):
            raise RuntimeError(f"error event: {json.dumps(event['error'])[:ERROR_BODY_CHARS]}")
        request = self.result.request
        for choice in event.get("choices") or []:
            if choice.get("finish_reason"):
                request.finish_reason = choice["finish_reason"]
            tokens = (choice.get("logprobs") or {}).get("tokens") or []
            self.result.answer_texts += tokens
            if not (tokens or choice.get("text")):
                continue
            if self.chunks == 0:
                request.ttft = now - self.start
            else:
                request.itl.append(now - self.last)
            self.last = now
            self.chunks += 1
        if event.get("usage"):
            self.usage = event["usage"]
        return False

    def finish(self) -> None:
        """Counts from the usage; RuntimeError unless every token came with its text."""
        result, request = self.result, self.result.request
        if self.chunks == 0:
            raise RuntimeError("stream ended without generated tokens")
        request.output_tokens = int(self.usage.get("completion_tokens") or self.chunks)
        request.prompt_tokens = int(self.usage.get("prompt_tokens") or result.prompt_len)
        cached = (self.usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        result.cached_tokens = None if cached is None else int(cached)
        if len(result.answer_texts) != request.output_tokens:
            raise RuntimeError(
                f"{request.output_tokens} tokens generated, but logprobs named "
                f"{len(result.answer_texts)}: the answer's ids are unknown"
            )


async def send_turn(
    session: aiohttp.ClientSession, url: str, payload: dict[str, Any], result: TurnResult
) -> None:
    """POST `payload`, consume and time its stream into `result`. Never raises for
    request-level problems: they come back as `result.request.success = False`."""
    request = result.request
    start = request.start_time = time.perf_counter()
    stream = TurnStream(result, start)
    try:
        await post_stream(session, url, payload, stream.feed)
        request.e2el = time.perf_counter() - start
        stream.finish()
        request.success = True
    except Exception as e:  # noqa: BLE001 -- a failed request is data, not a crash
        request.success = False
        request.error = f"{type(e).__name__}: {e}"
        if not request.e2el:
            request.e2el = time.perf_counter() - start


async def run_conversation(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    workload: Workload,
    conversation: int,
    output_len: int,
    table: dict[str, list[int]],
    filler: int,
    limiter: asyncio.Semaphore,
) -> list[TurnResult]:
    """Every turn of one conversation, back to back, holding one slot of `limiter`; it
    stops at a failed turn (the next one needs its answer)."""
    users = workload.users[conversation]
    results: list[TurnResult] = []
    answers: list[list[int]] = []
    async with limiter:
        for turn in range(len(users)):
            prompt = turn_prompt(workload.system, users[: turn + 1], answers)
            result = TurnResult(conversation, turn + 1, len(prompt))
            await send_turn(session, url, turn_payload(model, prompt, output_len), result)
            results.append(result)
            if not result.request.success:
                break
            ids, result.answer_tokens_inexact = resolve_answer(result.answer_texts, table, filler)
            answers.append(ids)
    return results


# ---------------------------------------------------------------- the run


async def fetch_json(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    async with session.get(url) as response:
        response.raise_for_status()
        return await response.json()


async def fetch_version(session: aiohttp.ClientSession, base_url: str) -> dict[str, Any] | None:
    """GET /version, or None where the server has none."""
    try:
        return await fetch_json(session, f"{base_url}/version")
    except aiohttp.ClientError:
        return None


async def benchmark(ns: argparse.Namespace) -> int:
    """Resolve the model, read the token texts, run the conversations, report."""
    base_url = base_url_of(ns)
    url = base_url + ENDPOINT_PATHS["completions"]
    timeout = aiohttp.ClientTimeout(total=ns.request_timeout)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        cards = (await fetch_json(session, f"{base_url}/v1/models")).get("data") or []
        if not cards:
            raise RuntimeError(f"{base_url}/v1/models lists no model")
        model = ns.model or cards[0]["id"]
        max_model_len = next((c.get("max_model_len") for c in cards if c["id"] == model), None)
        need = last_prompt_len(ns.system_len, ns.user_len, ns.output_len, ns.turns) + ns.output_len
        if max_model_len is not None and need > max_model_len:
            raise ValueError(f"the last turn needs {need} tokens; the context is {max_model_len}")
        version = await fetch_version(session, base_url)

        t0 = time.perf_counter()
        vocab = await vocab_size(session, base_url, model, DEFAULTS.max_vocab)
        if ns.token_range[1] > vocab:
            raise ValueError(f"--token-range {ns.token_range} is outside the vocabulary of {vocab}")
        chunk = min(ns.probe_chunk, max_model_len - 1) if max_model_len else ns.probe_chunk
        texts = await read_token_texts(
            session, url, model, vocab, chunk, DEFAULTS.probe_concurrency
        )
        table = ids_by_text(texts)
        shared = sum(len(ids) for ids in table.values() if len(ids) > 1)
        read_s = time.perf_counter() - t0
        print(f"Read the text of {vocab} token ids in {read_s:.1f} s ({shared} share theirs)")

        workload = make_workload(ns.num_conversations, ns.turns, ns.system_len, ns.user_len,
                                 ns.token_range, ns.seed)  # fmt: skip
        limiter = asyncio.Semaphore(ns.concurrency)
        print(
            f"Benchmarking {model} at {url}: {ns.num_conversations} conversations x "
            f"{ns.turns} turns, {ns.concurrency} in flight"
        )
        filler = ns.token_range[0]

        def conversation(c: int) -> Awaitable[list[TurnResult]]:
            args = (workload, c, ns.output_len, table, filler, limiter)
            return run_conversation(session, url, model, *args)

        start = time.perf_counter()
        conversations = await asyncio.gather(*map(conversation, range(ns.num_conversations)))
        duration = time.perf_counter() - start
    results = [r for conversation in conversations for r in conversation]
    summary = summarize_turns(results, duration, ns.turns, ns.num_conversations)
    errors = list(dict.fromkeys(r.request.error for r in results if not r.request.success))
    print(format_report(summary, errors[: DEFAULTS.shown_errors]))
    if ns.output_json:
        report = {
            "bench": "multiturn",
            "tag": ns.tag,
            "device_kind": ns.device_kind,
            "commit": git_commit(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
            "base_url": base_url,
            "model": model,
            "server_version": version,
            "args": vars(ns),
            "vocab": {"size": vocab, "ids_with_shared_text": shared, "read_s": read_s},
            "summary": summary,
            "per_request": [request_row(r, start) for r in results],
        }
        report_json.write(ns.output_json, report)
        print(f"Wrote {ns.output_json}")
    return 0 if summary["failed"] == 0 else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: 0 when every request succeeded, 1 when some failed, 2 when the run
    could not start."""
    ns = parse_args(argv)
    try:
        return asyncio.run(benchmark(ns))
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, ValueError) as e:
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
