"""Streaming OpenAI-compatible HTTP client used by the serving benchmark.

Every request is sent with ``stream: true`` and
``stream_options: {"include_usage": true}``; the Server-Sent-Events body is
parsed incrementally and each chunk carrying generated text is timestamped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Literal

import aiohttp

from gyrfalcon.bench.datasets import SampleRequest
from gyrfalcon.bench.metrics import RequestResult

Endpoint = Literal["completions", "chat"]

ENDPOINT_PATHS: dict[str, str] = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
}
DONE_SENTINEL = "[DONE]"
ERROR_BODY_CHARS = 500  # how much of a failed response body is kept


class SSEDecoder:
    """Incremental Server-Sent-Events parser that yields ``data`` payloads.

    Bytes are fed as they arrive; an event is complete at a blank line and
    its ``data:`` lines are joined with newlines. Comment lines (``:``) and
    other fields (``event:``, ``id:``, ...) are ignored.
    """

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """Consume ``chunk`` and return the payloads of events it completed."""
        self._buffer += chunk
        payloads: list[str] = []
        while True:
            newline = self._buffer.find(b"\n")
            if newline < 0:
                break
            raw, self._buffer = self._buffer[:newline], self._buffer[newline + 1 :]
            payload = self._line(raw.rstrip(b"\r").decode("utf-8", errors="replace"))
            if payload is not None:
                payloads.append(payload)
        return payloads

    def flush(self) -> list[str]:
        """End of stream: return a last event that had no trailing blank line."""
        payloads = self.feed(b"\n") if self._buffer else []
        if self._data:
            payloads.append("\n".join(self._data))
            self._data = []
        return payloads

    def _line(self, line: str) -> str | None:
        if not line:  # blank line: dispatch the pending event
            if not self._data:
                return None
            payload, self._data = "\n".join(self._data), []
            return payload
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if name == "data":
            self._data.append(value.removeprefix(" "))
        return None


def build_payload(
    endpoint: Endpoint,
    model: str,
    sample: SampleRequest,
    ignore_eos: bool = False,
    extra_body: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON body of one streamed request for ``sample``: greedy (temperature 0)
    unless ``extra_body`` says otherwise, as SGLang's and vLLM's serving benchmarks send."""
    payload: dict[str, Any] = {
        "model": model,
        "temperature": 0.0,
        "max_tokens": sample.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        if not isinstance(sample.prompt, str):
            raise ValueError("the chat endpoint needs text prompts, not token ids")
        payload["messages"] = [{"role": "user", "content": sample.prompt}]
    else:
        payload["prompt"] = sample.prompt
    if ignore_eos:
        payload["ignore_eos"] = True
    if extra_body:
        payload.update(extra_body)
    return payload


def _chunk_text(choice: dict[str, Any]) -> str:
    """Generated text in one streamed choice (completions or chat shape)."""
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


async def post_stream(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    handle: Callable[[str, float], bool],
) -> None:
    """POST ``payload`` and feed each SSE event payload to ``handle(data, arrival
    time)`` until it returns True (the end of the stream) or the stream ends. Raises
    RuntimeError on an HTTP error status."""
    decoder = SSEDecoder()
    async with session.post(url, json=payload) as response:
        if response.status != 200:
            body = (await response.text())[:ERROR_BODY_CHARS]
            raise RuntimeError(f"HTTP {response.status}: {body}")
        done = False
        async for chunk in response.content.iter_any():
            now = time.perf_counter()
            for data in decoder.feed(chunk):
                done = done or handle(data, now)
            if done:
                break
        if not done:
            for data in decoder.flush():
                handle(data, time.perf_counter())


async def send_request(
    session: aiohttp.ClientSession,
    url: str,
    payload: dict[str, Any],
    prompt_len: int | None = None,
) -> RequestResult:
    """POST ``payload`` to ``url``, consume the SSE stream and time it.

    Never raises for request-level problems: HTTP errors, error events and
    connection failures come back as ``success=False`` with ``error`` set.
    """
    result = RequestResult()
    usage: dict[str, Any] = {}
    text_chunks = 0
    last = start = result.start_time = time.perf_counter()

    def handle(data: str, now: float) -> bool:
        """Process one event payload; return True at the end of the stream."""
        nonlocal last, text_chunks, usage
        if data.strip() == DONE_SENTINEL:
            return True
        event = json.loads(data)
        if event.get("error"):
            raise RuntimeError(f"error event: {json.dumps(event['error'])[:ERROR_BODY_CHARS]}")
        for choice in event.get("choices") or []:
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
            if not _chunk_text(choice):
                continue
            if text_chunks == 0:
                result.ttft = now - start
            else:
                result.itl.append(now - last)
            last = now
            text_chunks += 1
        if event.get("usage"):
            usage = event["usage"]
        return False

    try:
        await post_stream(session, url, payload, handle)
        result.e2el = time.perf_counter() - start
        if text_chunks == 0:
            raise RuntimeError("stream ended without generated text")
        result.output_tokens = int(usage.get("completion_tokens") or text_chunks)
        result.prompt_tokens = int(usage.get("prompt_tokens") or prompt_len or 0)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        result.cached_tokens = None if cached is None else int(cached)
        result.success = True
    except Exception as e:  # noqa: BLE001 -- a failed request is data, not a crash
        result.success = False
        result.error = f"{type(e).__name__}: {e}"
        if not result.e2el:
            result.e2el = time.perf_counter() - start
    return result


async def fetch_model_ids(session: aiohttp.ClientSession, base_url: str) -> list[str]:
    """Model ids listed by ``GET {base_url}/v1/models``."""
    async with session.get(f"{base_url}/v1/models") as response:
        response.raise_for_status()
        body = await response.json()
    return [m["id"] for m in body.get("data", []) if "id" in m]
