"""API keys: `--api-key KEY` (or the `GYRFALCON_API_KEY` variable) makes every route
but liveness and metrics (`OPEN_PATHS`) require `Authorization: Bearer KEY`, the header
the official `openai` client sends; anything else gets OpenAI's 401.

A pure ASGI middleware: it answers before FastAPI parses a body, and passes streams
through untouched. Keys are compared in constant time over their SHA-256 digests, so
neither the content nor the length of the key leaks through timing.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from http import HTTPStatus
from typing import Any

API_KEY_ENV = "GYRFALCON_API_KEY"
OPEN_PATHS = frozenset({"/health", "/version", "/metrics"})  # what probes and scrapers read
Scope = dict[str, Any]


def resolve_api_key(flag: str | None) -> str | None:
    """--api-key, else $GYRFALCON_API_KEY; None (no auth) when neither is set. An
    empty key is refused: it would read as "auth on" while any client passes with
    `Bearer ` and nothing after it."""
    key = flag if flag is not None else os.environ.get(API_KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError(f"--api-key / ${API_KEY_ENV} is set but empty")
    return key


def bearer_token(scope: Scope) -> str | None:
    """The token of the request's `Authorization: Bearer <token>` header, if any."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode("utf-8")).digest()


class ApiKeyAuth:
    """ASGI middleware: HTTP requests outside OPEN_PATHS need the key (CORS preflights,
    OPTIONS, pass: browsers send them without credentials)."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self._digest = _digest(api_key)

    def allowed(self, scope: Scope) -> bool:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            return True
        if scope.get("method") == "OPTIONS":
            return True
        token = bearer_token(scope)
        return token is not None and hmac.compare_digest(_digest(token), self._digest)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if self.allowed(scope):
            await self.app(scope, receive, send)
            return
        # NOTE: here, not at import: the command line reads `resolve_api_key` before it
        # spawns the ranks, and the serving modules import torch (the server has them)
        from gyrfalcon.frontend.serving_common import send_error

        await send_error(
            send, HTTPStatus.UNAUTHORIZED, "invalid or missing API key",
            [(b"www-authenticate", b"Bearer")],
        )  # fmt: skip
