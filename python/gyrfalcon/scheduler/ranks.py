"""Per-DP-rank scheduler state.

Every DP rank has its own KV pool, so its own page allocator, its own queues and
its own admission reserve; a request is bound to one rank when it arrives and
stays there (its pages and the worker state of its DP group live there). Each
step plans every rank and sends one `StepPlan` holding all their batches; each
rank's results come back in plan order, on their own.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from gyrfalcon.scheduler.page_allocator import PageAllocator
from gyrfalcon.scheduler.policy import Decision, ReserveRatio
from gyrfalcon.scheduler.prefix_cache import PrefixCache
from gyrfalcon.scheduler.request import Request


@dataclass
class RankState:
    dp_rank: int
    alloc: PageAllocator
    reserve: ReserveRatio
    running: list[Request] = field(default_factory=list)
    waiting: deque[Request] = field(default_factory=deque)
    finished_for_worker: list[str] = field(default_factory=list)  # sent with the next plan
    inflight: deque[tuple[int, Decision]] = field(default_factory=deque)  # (step_id, decision)
    cache: PrefixCache | None = None  # prefix caching on this rank's pages

    def has_work(self) -> bool:
        """Requests to run, results to wait for, or finished requests its workers hold."""
        return bool(self.running or self.waiting or self.inflight or self.finished_for_worker)

    @property
    def num_requests(self) -> int:
        return len(self.running) + len(self.waiting)


def pick_rank(ranks: Sequence[RankState]) -> int:
    """The DP rank a new request joins: the one with the fewest requests (lowest
    rank on ties; with one rank, always 0)."""
    return min(ranks, key=lambda r: (r.num_requests, r.dp_rank)).dp_rank
