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


def pick_rank(ranks: Sequence[RankState], req: Request) -> int:
    """The DP rank a new request joins: of the ranks within `rank_slack` requests of the
    least loaded one, the one whose prefix cache holds most of the request's tokens
    (a chat's next turn goes where its earlier turns' pages are); on a tie, the fewest
    requests, then the lowest rank. Without prefix caching or a hit this is the least
    loaded rank."""
    if len(ranks) == 1:
        return ranks[0].dp_rank
    least = min(r.num_requests for r in ranks)
    near = [r for r in ranks if r.num_requests <= least + rank_slack(least)]

    def order(r: RankState) -> tuple[int, int, int]:
        hit = r.cache.cached_tokens(req) if r.cache is not None else 0
        return -hit, r.num_requests, r.dp_rank

    return min(near, key=order).dp_rank


def rank_slack(least: int) -> int:
    """How many requests more than the least loaded rank a rank may hold and still take
    a request for its cached prefix: 2, or 1/16 of the load. A step lasts as long as
    its busiest rank, so this bounds the decode cost of routing by cache to ~6% at
    load, against a prompt's cached pages not computed again."""
    return max(2, least // 16)
