"""An aiohttp app on a free 127.0.0.1 port, served from its own thread: the base of the
fake OpenAI servers the benchmark tests talk to."""

from __future__ import annotations

import asyncio
import socket
import threading

from aiohttp import web


class ThreadedApp:
    """`with Subclass() as s:` serves `routes`' app at `s.url` until the block ends."""

    def __init__(self) -> None:
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def _start(self, sock: socket.socket) -> None:
        app = web.Application()
        self.routes(app)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.SockSite(self._runner, sock).start()

    def __enter__(self):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))  # the OS picks a free port
        self.port = sock.getsockname()[1]
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(sock), self._loop).result(timeout=5)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
