"""Which API server (--api-server-count) gets each request's outputs.

Every API server sends its requests to the one scheduler; the router remembers the
sender of each request until its final output (the one with a finish reason: every
request gets exactly one, also when it is rejected, aborted or failed) and splits a
step's outputs by sender. With one API server everything is its own and nothing is
kept.
"""

from __future__ import annotations

from collections.abc import Collection

from gyrfalcon.ipc.messages import RequestOutput


class OutputRouter:
    def __init__(self, num_servers: int):
        assert num_servers >= 1, num_servers
        self.num_servers = num_servers
        # NOTE: a list per rid: a duplicate rid (answered with an error output by the
        # scheduler) comes from the same API server, as rids carry their sender's index
        # (frontend/engine_client.py); each final output ends one entry
        self._senders: dict[str, list[int]] = {}

    def add(self, rid: str, api_server: int) -> None:
        """A request arrives from `api_server`."""
        assert 0 <= api_server < self.num_servers, f"no API server {api_server}"
        if self.num_servers > 1:
            self._senders.setdefault(rid, []).append(api_server)

    def split(self, outputs: list[RequestOutput]) -> list[list[RequestOutput]]:
        """`outputs` by API server (indexed by it, order kept); a final output ends its
        request's entry."""
        if self.num_servers == 1:
            return [outputs]
        per_server: list[list[RequestOutput]] = [[] for _ in range(self.num_servers)]
        for out in outputs:
            senders = self._senders.get(out.rid)
            assert senders, f"output of request {out.rid}, which no API server sent"
            per_server[senders[0]].append(out)
            if out.finish_reason is not None:
                senders.pop(0)
                if not senders:
                    del self._senders[out.rid]
        return per_server

    @property
    def num_tracked(self) -> int:
        """Requests whose final output has not gone out yet (0 with one API server)."""
        return sum(len(s) for s in self._senders.values())

    def check(self, live: Collection[str]) -> str | None:
        """An error text unless the router tracks exactly the `live` requests (those
        the scheduler will still send an output for); None with one API server."""
        if self.num_servers == 1:
            return None
        leaked = self._senders.keys() - set(live)
        missing = set(live) - self._senders.keys()
        if not (leaked or missing):
            return None
        return (
            f"API server routes out of step: {len(leaked)} kept for ended requests "
            f"{sorted(leaked)[:3]}, {len(missing)} missing for live ones {sorted(missing)[:3]}"
        )
