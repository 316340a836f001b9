"""`--max-request-body-bytes`: a request body above the limit gets OpenAI's 400 before
anything parses it, so no client can make the frontend buffer and decode an
arbitrarily large JSON document.

A pure ASGI middleware. A declared `Content-Length` over the limit is refused at
once. A body without one (chunked) is read here up to the limit, then handed to the
app in one piece; what the client sends after it (a disconnect) passes through.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from gyrfalcon.frontend.serving_common import send_error

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # a 128 k-token prompt as ids is ~1 MB


def content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyLimit:
    def __init__(self, app: Any, max_bytes: int):
        assert max_bytes >= 1, max_bytes
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self) -> str:
        return f"the request body exceeds {self.max_bytes} bytes (--max-request-body-bytes)"

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = content_length(scope)
        if length is not None:
            if length > self.max_bytes:
                await send_error(send, HTTPStatus.BAD_REQUEST, self._too_large())
                return
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        total, more = 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # NOTE: the client left mid-body
                return
            chunk = message.get("body", b"")
            total += len(chunk)
            if total > self.max_bytes:
                await send_error(send, HTTPStatus.BAD_REQUEST, self._too_large())
                return
            chunks.append(chunk)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)
