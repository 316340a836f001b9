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
from gyrfalcon.scheduler.policy import RESERVE_CLIP, Decision, ReserveRatio
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


def tokens_to_go(req: Request) -> int:
    """Tokens req has still to put through the model: its prompt not yet computed
    and the output it may still generate (max_tokens, clipped as the admission
    reserve clips it: without a max_tokens it could run to the context length)."""
    prompt = max(0, len(req.prompt_ids) - req.num_computed)
    return prompt + max(0, min(req.sampling.max_tokens - req.num_generated, RESERVE_CLIP))


def pick_rank(ranks: Sequence[RankState]) -> int:
    """The DP rank a new request joins: the one with the fewest tokens still to go
    (`tokens_to_go` over its requests), then the fewest requests, then the lowest rank.

    NOTE: every rank runs each step together, so the run ends with the rank that has
    the most work left. Balancing request counts alone let one rank collect the long
    requests and decode them alone at the end: the 8B shape at dp 2, concurrency 256
    (random 1024 in / 512 out), had one rank idle for a third of the steps
    (benchmarks/NOTES.md)."""

    def load(r: RankState) -> tuple[int, int, int]:
        work = sum(tokens_to_go(q) for q in r.running) + sum(tokens_to_go(q) for q in r.waiting)
        return work, r.num_requests, r.dp_rank

    return min(ranks, key=load).dp_rank
