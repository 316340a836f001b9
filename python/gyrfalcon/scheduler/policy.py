"""Step policy: decide how far each request advances this step.

Order: running decodes (one token each), then unfinished prefills of running
requests, then new requests FCFS. Limits: a token budget per step
(max_num_batched_tokens), a prefill-token budget per step (chunked_prefill_size),
max_num_seqs running requests, and free KV pages. A request with a sampled token
still in flight (overlap scheduling) only advances as a decode, and not past
max_tokens or the context length counting that token. A request whose row in
flight may emit more than one token (it has draft slots) is planned again before
that result is in only as a floating row (`floats`): its start is then known on
the device alone (request.py), so it gets pages for the start at its latest; else
it waits for the result. When a decode needs a page and none is free,
the most recently admitted running request is preempted (its pages freed,
recomputed later from position 0).

Admission keeps room for the output still to come: a new request is admitted only
if its prompt fits beside a reserve of `reserve_ratio` x (tokens each running
request, and the new one, may still generate, clipped at RESERVE_CLIP). Without
it, prompts fill the cache, decodes outgrow it, and preemption recomputes whole
prompts over and over. The scheduler adapts the ratio (see `ReserveRatio`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gyrfalcon.ipc.contract import pages_needed, verifies_drafts
from gyrfalcon.scheduler.page_allocator import PageAllocator
from gyrfalcon.scheduler.prefix_cache import PrefixCache
from gyrfalcon.scheduler.request import Request, Status, draft_slots, kv_end


@dataclass(frozen=True)
class Limits:
    max_num_batched_tokens: int
    chunked_prefill_size: int
    max_num_seqs: int
    page_size: int
    max_model_len: int = 1 << 62
    num_draft: int = 0  # draft slots per decode row (speculative decoding; 0 = off)
    # the workers start a row where the request's row in flight ends, on the device
    # (floating rows: overlap scheduling for speculative decoding)
    float_rows: bool = False
    # KV positions the drafter writes past a sampling row's last emitted token (its
    # draft steps after the first: k - 1 with EAGLE3); held with the row's pages
    draft_lookahead: int = 0
    # a step holds prefill rows (chunks, admissions) or decode rows, never both
    # (--separate-prefill-steps): prefill first, decodes when no prefill row is planned
    separate_prefill: bool = False


# Output tokens counted per request in the admission reserve, at most: a request
# without max_tokens may run to the context length, which is no estimate.
RESERVE_CLIP = 4096


@dataclass
class Scheduled:
    req: Request
    num_tokens: int  # tokens computed this step, from req.num_computed
    new_pages: list[int]
    reset: bool  # request was preempted since the worker last saw it
    samples: bool  # the step reaches the last token, so it samples the next
    start: int  # first position computed (req.num_computed when planned): a lower bound
    num_draft: int = 0  # draft tokens the worker appends and verifies (KV held for them)
    # drafts of rows in flight that may still be accepted (a floating row's start is
    # start + their accepted count, known on the device only; request.py)
    drafts_in_flight: int = 0


@dataclass
class Decision:
    rows: list[Scheduled] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.rows)


def max_tokens_fitting(req: Request, free_pages: int, page_size: int) -> int:
    """How many more tokens of req fit in held pages plus free_pages."""
    return (len(req.pages) + free_pages) * page_size - req.num_computed


def preempt(
    req: Request, alloc: PageAllocator, running: list[Request], waiting: deque[Request]
) -> None:
    alloc.free(req.pages)
    req.pages = []
    req.num_computed = 0
    req.cache_node, req.num_cache_pages = 0, 0  # NOTE: the prefix cache's root
    req.status = Status.WAITING
    req.needs_reset = True
    running.remove(req)
    # NOTE: back to the queue in arrival order so it is the next to be re-admitted
    idx = 0
    while idx < len(waiting) and waiting[idx].arrival < req.arrival:
        idx += 1
    waiting.insert(idx, req)


def drafts_for(req: Request, limits: Limits) -> bool:
    """Whether the request takes part in speculative decoding (drafts, lookahead)."""
    return limits.num_draft > 0 and verifies_drafts(req.sampling)


def floats(req: Request, limits: Limits) -> bool:
    """Whether req, with a row in flight that may emit several tokens, is planned again
    now, as a floating row: only where the workers take its start from the device
    (`float_rows`), its row gets k drafts whatever the row in flight accepts (so
    draft counts, random draws and outputs are those of planning after the result),
    and min_tokens no longer holds stop tokens back (the worker's count of tokens
    generated is a lower bound for a floating row)."""
    left = req.tokens_left(limits.max_model_len) - req.num_pending_drafts
    return (
        limits.float_rows
        and left > limits.num_draft
        and req.num_generated >= req.sampling.min_tokens
    )


def row_end(req: Request, n: int, num_draft: int, limits: Limits) -> int:
    """End of the KV positions a row of req from num_computed writes with every draft
    in flight accepted (its latest start), the drafter's lookahead included for a
    sampling row (never past the context length)."""
    end = kv_end(req.num_computed + req.num_pending_drafts, n, num_draft)
    if req.num_computed + n == req.num_tokens and drafts_for(req, limits):
        end = min(end + limits.draft_lookahead, limits.max_model_len)
    return end


def _take(
    req: Request,
    n: int,
    alloc: PageAllocator,
    limits: Limits,
    num_draft: int = 0,
    end: int | None = None,
) -> Scheduled:
    """Plan a row of req's next n tokens (and num_draft drafts) with pages up to its
    `row_end` (`end`, where the caller has it)."""
    start = req.num_computed
    if end is None:
        end = row_end(req, n, num_draft, limits)
    new_pages = alloc.alloc(pages_needed(len(req.pages), end, limits.page_size))
    req.pages.extend(new_pages)
    reset, req.needs_reset = req.needs_reset, False
    samples = start + n == req.num_tokens
    assert samples or not num_draft, "only a sampling row verifies drafts"
    return Scheduled(req, n, new_pages, reset, samples, start, num_draft, req.num_pending_drafts)


def reserved_tokens(req: Request, ratio: float) -> int:
    """Tokens of KV kept free at admission for req's output still to come."""
    left = min(req.sampling.max_tokens - req.num_generated, RESERVE_CLIP)
    return int(ratio * max(0, left))


@dataclass
class ReserveRatio:
    """The admission reserve's ratio, adapted to how outputs actually grow.

    Starts at `init`; every step without a preemption lowers it by `decay` down to
    `floor` (requests often stop well before max_tokens); a preemption puts it
    back to `init`.
    """

    init: float = 0.7
    floor: float = 0.1
    decay: float = 0.001
    value: float = field(init=False)

    def __post_init__(self) -> None:
        assert 0.0 <= self.floor <= self.init, "need 0 <= floor <= init"
        self.value = self.init

    @classmethod
    def scaled(cls, conservativeness: float) -> ReserveRatio:
        """The default ratios times `--schedule-conservativeness` (0: no reserve)."""
        assert conservativeness >= 0, conservativeness
        return cls(min(1.0, cls.init * conservativeness), min(1.0, cls.floor * conservativeness))

    def update(self, decision: Decision) -> None:
        if decision.preempted:
            self.value = self.init
        elif decision.rows:
            self.value = max(self.floor, self.value - self.decay)


def schedule(
    running: list[Request],
    waiting: deque[Request],
    alloc: PageAllocator,
    limits: Limits,
    reserve_ratio: float = 0.0,
    cache: PrefixCache | None = None,
) -> Decision:
    """Plan one step. Mutates page ownership, queues and statuses; not num_computed,
    but for a request admitted on a cached prefix (`cache`: its positions count as
    computed from the start).

    reserve_ratio: the share of each request's remaining output kept free at
    admission (0 admits whenever the prompt fits). limits.separate_prefill: the
    decodes are planned only in a step without prefill rows (after 2 and 3, if those
    planned none) instead of first.
    """
    ps = limits.page_size
    out = Decision()
    budget = limits.max_num_batched_tokens
    prefill_budget = limits.chunked_prefill_size
    picked: set[str] = set()

    def decodes() -> None:
        """1) decodes, oldest first; preempt the newest when pages run out"""
        nonlocal budget
        for req in sorted(running, key=lambda r: r.arrival):
            if budget <= 0:
                break
            if req.remaining != 1 or req.status is not Status.RUNNING:
                continue
            if req.num_pending_drafts and not floats(req, limits):
                continue  # NOTE: its row in flight may emit 1..d+1 tokens: wait for them
            left = req.tokens_left(limits.max_model_len) - req.num_pending_drafts
            if left <= 0:
                continue  # its last token is in flight; the result finishes it
            room = req.room(limits.max_model_len) - req.num_pending_drafts
            d = draft_slots(limits.num_draft, room) if drafts_for(req, limits) else 0
            end = row_end(req, 1, d, limits)
            while pages_needed(len(req.pages), end, ps) > alloc.num_free:
                victims = [r for r in running if r.rid not in picked]
                victim = max(victims, key=lambda r: r.arrival)
                preempt(victim, alloc, running, waiting)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            out.rows.append(_take(req, 1, alloc, limits, d, end))
            picked.add(req.rid)
            budget -= 1 + d  # the forward computes the input and the d drafts

    if not limits.separate_prefill:
        decodes()

    # 2) running requests still in (chunked) prefill
    for req in sorted(running, key=lambda r: r.arrival):
        if req.rid in picked or req.num_pending or req.remaining <= 1 and req.output_ids:
            continue
        n = min(req.remaining, budget, prefill_budget, max_tokens_fitting(req, alloc.num_free, ps))
        if (
            n == req.remaining
            and pages_needed(len(req.pages), row_end(req, n, 0, limits), ps) > alloc.num_free
        ):
            n -= 1  # NOTE: the drafter's lookahead does not fit: stop short of sampling
        if n <= 0:
            continue
        out.rows.append(_take(req, n, alloc, limits))
        picked.add(req.rid)
        budget -= n
        prefill_budget -= n

    # 3) admit waiting requests FCFS while everything fits, output reserve included
    reserve = 0
    if waiting and len(running) < limits.max_num_seqs:  # NOTE: a sum over the running set
        reserve = sum(reserved_tokens(r, reserve_ratio) for r in running)
    while waiting and len(running) < limits.max_num_seqs and budget > 0 and prefill_budget > 0:
        req = waiting[0]
        if req.num_pending:
            break  # preempted with a token in flight: re-admit once it is back
        hit = cache.acquire(req) if cache is not None else 0
        held = len(req.pages)
        # NOTE: admit only when the whole remaining prompt fits in free pages, so a
        # long prompt cannot grab pages chunk by chunk and starve the running set.
        fits = pages_needed(held, row_end(req, req.remaining, 0, limits), ps) <= alloc.num_free
        own = reserved_tokens(req, reserve_ratio)
        # NOTE: with nothing running the prompt alone decides (progress)
        if fits and running:
            fits = pages_needed(held, req.num_tokens + reserve + own, ps) <= alloc.num_free
        if not fits:
            if cache is not None:
                cache.release(req)
            break
        if cache is not None:
            cache.count(req.num_tokens, hit)
            if not req.sent_to_worker:
                req.num_cached_tokens = hit
        reserve += own
        waiting.popleft()
        req.status = Status.RUNNING
        running.append(req)
        n = min(req.remaining, budget, prefill_budget)
        out.rows.append(_take(req, n, alloc, limits))
        out.rows[-1].new_pages[:0] = req.pages[:held]  # NOTE: the cached prefix's pages
        picked.add(req.rid)
        budget -= n
        prefill_budget -= n
    if limits.separate_prefill and not out.rows:
        decodes()
    return out
