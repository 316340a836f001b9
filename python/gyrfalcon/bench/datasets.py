"""Benchmark workloads: the prompts to send and when to send them.

Two prompt sources:

* ``random`` -- synthetic prompts of random token ids with lengths drawn
  uniformly from ``[max(1, round(L * ratio)), L]`` (so ``ratio = 1.0`` means
  exactly ``L`` and ``ratio = 0.0`` means anything from 1 to ``L``). Prompts are
  sent as token-id lists by default, so no tokenizer is needed; a tokenizer can
  decode them to text instead.
* ``jsonl`` -- one JSON object per line with ``"prompt"`` (a string or a list
  of token ids) or ``"turns"`` (a list; the first turn is used, as in MT-Bench
  question files), and an optional ``"output_len"`` or ``"max_tokens"``.

Arrival times follow a Poisson process: gaps between requests are exponential
with mean ``1 / rate``; an infinite rate sends everything at once.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

Prompt = str | list[int]


class TokenizerLike(Protocol):
    """The part of a Hugging Face tokenizer the workloads use."""

    all_special_ids: list[int]

    def __len__(self) -> int: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


@dataclass(frozen=True)
class SampleRequest:
    """One request of the workload.

    ``prompt_len`` is the prompt length known before sending (None when it is
    unknown, e.g. a text prompt without a tokenizer); the server's usage
    report is authoritative when it comes back.
    """

    prompt: Prompt
    prompt_len: int | None
    output_len: int


def length_bounds(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive bounds ``(low, high)`` of a length drawn around ``length``.

    ``low = max(1, round(length * range_ratio))`` and ``high = length``.
    """
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio <= 1.0:
        raise ValueError(f"range ratio must be in [0, 1], got {range_ratio}")
    return max(1, round(length * range_ratio)), length


def sample_lengths(
    rng: np.random.Generator, num: int, length: int, range_ratio: float
) -> list[int]:
    """Draw ``num`` integer lengths uniformly from :func:`length_bounds`."""
    low, high = length_bounds(length, range_ratio)
    return [int(x) for x in rng.integers(low, high + 1, size=num)]


def _token_pool(tokenizer: TokenizerLike | None, token_range: tuple[int, int] | None) -> np.ndarray:
    """The token ids random prompts are drawn from.

    An explicit ``token_range`` ``[low, high)`` wins; otherwise the whole
    tokenizer vocabulary minus its special tokens is used.
    """
    if token_range is not None:
        low, high = token_range
        if not 0 <= low < high:
            raise ValueError(f"bad token range [{low}, {high})")
        return np.arange(low, high, dtype=np.int64)
    if tokenizer is None:
        raise ValueError("random prompts need a token range or a tokenizer")
    special = set(tokenizer.all_special_ids)
    pool = np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)
    if pool.size == 0:
        raise ValueError("tokenizer has no non-special tokens")
    return pool


def sample_random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float,
    seed: int,
    token_range: tuple[int, int] | None = None,
    tokenizer: TokenizerLike | None = None,
    as_text: bool = False,
) -> list[SampleRequest]:
    """Build ``num_prompts`` random-token prompts, deterministic for ``seed``.

    With ``as_text`` the ids are decoded with ``tokenizer`` and sent as a
    string (its re-tokenized length may differ slightly from ``prompt_len``).
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if as_text and tokenizer is None:
        raise ValueError("text prompts need a tokenizer")
    rng = np.random.default_rng(seed)
    input_lens = sample_lengths(rng, num_prompts, input_len, range_ratio)
    output_lens = sample_lengths(rng, num_prompts, output_len, range_ratio)
    pool = _token_pool(tokenizer, token_range)
    requests: list[SampleRequest] = []
    for in_len, out_len in zip(input_lens, output_lens):
        ids = [int(t) for t in rng.choice(pool, size=in_len)]
        prompt: Prompt = tokenizer.decode(ids) if as_text and tokenizer else ids
        requests.append(SampleRequest(prompt=prompt, prompt_len=in_len, output_len=out_len))
    return requests


def _prompt_of(record: dict[str, Any], where: str) -> Prompt:
    """Extract the prompt of one jsonl record (``prompt`` or first of ``turns``)."""
    if "prompt" in record:
        prompt = record["prompt"]
    elif "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"{where}: 'turns' must be a non-empty list")
        prompt = turns[0]
        if isinstance(prompt, dict):  # chat-style turn: {"role": ..., "content": ...}
            prompt = prompt.get("content")
    else:
        raise ValueError(f"{where}: needs a 'prompt' or a 'turns' field")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [int(t) for t in prompt]
    raise ValueError(f"{where}: prompt must be a string or a list of token ids")


def parse_jsonl_record(
    record: Any,
    default_output_len: int,
    where: str = "record",
    tokenizer: TokenizerLike | None = None,
) -> SampleRequest:
    """Turn one decoded jsonl line into a :class:`SampleRequest`."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object")
    prompt = _prompt_of(record, where)
    out_len = record.get("output_len", record.get("max_tokens", default_output_len))
    if not isinstance(out_len, int) or out_len < 1:
        raise ValueError(f"{where}: output length must be a positive integer, got {out_len!r}")
    if isinstance(prompt, list):
        prompt_len: int | None = len(prompt)
    elif tokenizer is not None:
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
    else:
        prompt_len = None
    return SampleRequest(prompt=prompt, prompt_len=prompt_len, output_len=out_len)


def load_jsonl_requests(
    path: str | Path,
    default_output_len: int,
    num_prompts: int | None = None,
    tokenizer: TokenizerLike | None = None,
) -> list[SampleRequest]:
    """Read requests from a jsonl file, in file order, at most ``num_prompts``.

    Blank lines are skipped; a malformed line raises ``ValueError`` naming it.
    """
    requests: list[SampleRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if num_prompts is not None and len(requests) >= num_prompts:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e})") from e
            requests.append(parse_jsonl_record(record, default_output_len, where, tokenizer))
    if not requests:
        raise ValueError(f"{path}: no requests found")
    return requests


def poisson_gaps(num: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """``num`` inter-arrival gaps in seconds: exponential with mean ``1/rate``.

    ``rate = inf`` gives all-zero gaps (every request at once).
    """
    if rate <= 0 or math.isnan(rate):
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return np.zeros(num, dtype=np.float64)
    return rng.exponential(1.0 / rate, size=num)


def arrival_offsets(num: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Send time of each request relative to the start; the first is at 0."""
    gaps = poisson_gaps(num, rate, rng)
    offsets = np.zeros(num, dtype=np.float64)
    if num > 1:
        offsets[1:] = np.cumsum(gaps[:-1])
    return offsets
