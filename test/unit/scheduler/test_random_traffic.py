"""Seeded random traffic through the scheduler, against a fake worker whose KV is content.

The fake worker (one per DP rank) simulates the KV of every physical slot as what a
real model writes there: the target's KV at position p is a function of the token
prefix seq[:p + 1] (a hash of it), the EAGLE3 drafter's a function of seq[:p + 2] (it
pairs position p with the token after it). A page shared through the prefix cache,
written by another request with the same prefix, therefore reads as right; a page
reused too early, evicted while in use, matched with other content or cached before
its content was whole reads as wrong. Rejected drafts and the drafter's lookahead
steps write garbage. The 'model' is a function of the token prefix, not of the
request, so equal prompts give equal greedy continuations; it emits EOS now and then.
The fake runs each plan when it is submitted: in plan order, as the real workers do.

Traffic per seed: prompts made from a few shared prefixes (the same prompt several
times in one burst too), arrivals between steps, aborts of waiting and running
requests, and a page pool small enough that the prefix cache evicts and running
requests are preempted. Every request must end exactly once and every page come back,
and the outputs of the requests not aborted must equal those of a reference run of
the same traffic: no drafts, no overlap, no prefix caching, a big pool.
"""

from __future__ import annotations

import functools
import random
from collections import Counter, deque
from dataclasses import dataclass, field

import pytest

from gyrfalcon.ipc.contract import PLACEHOLDER, verifies_drafts
from gyrfalcon.ipc.messages import (
    GenerateRequest,
    RowResult,
    SamplingParams,
    ScheduledRow,
    StepPlan,
    StepResult,
)
from gyrfalcon.scheduler.scheduler import Scheduler, SchedulerConfig

EOS = 3
PS = 4  # page size
MAX_LEN = 40  # the context length
VOCAB = 40  # the model's other tokens: 10 .. 10 + VOCAB - 1
GARBAGE = -1  # what a rejected draft or a draft step writes (prefix hashes are >= 0)
MOD = (1 << 61) - 1
SEEDS = range(32)
TRAFFIC_STEPS = 40  # pumps during which requests arrive and are aborted


def extend(h: int, tok: int) -> int:
    """The hash of a token prefix with `tok` after it, from the prefix's hash h."""
    return (h * 1_000_003 + tok + 11) % MOD


def next_token(h: int) -> int:
    """The 'model': the token after the prefix whose hash is h (EOS about 1 in 16)."""
    return EOS if h % 16 == 0 else 10 + (h >> 8) % VOCAB


@dataclass
class Seq:
    """What a worker knows of a request: its true tokens, their prefixes' hashes."""

    tokens: list[int]
    drafts: bool  # its rows draft: the drafter writes KV for it
    hashes: list[int] = field(default_factory=list)  # hashes[p]: of tokens[: p + 1]

    def __post_init__(self) -> None:
        self.grow(0)

    def grow(self, n: int) -> None:
        """The true sequence to at least n tokens, every known token hashed."""
        while len(self.hashes) < max(n, len(self.tokens)):
            h = self.hashes[-1] if self.hashes else 0
            if len(self.tokens) == len(self.hashes):
                self.tokens.append(next_token(h))
            self.hashes.append(extend(h, self.tokens[len(self.hashes)]))


@dataclass
class Ran:
    """A row as the worker ran it: inputs at [start, end), a of its d drafts accepted."""

    rid: str
    start: int
    end: int
    d: int
    a: int
    sample: bool


class ContentWorker:
    """One DP rank's workers: the target's and the drafter's KV per slot, as content."""

    def __init__(self, dp_rank: int, k: int, rng: random.Random):
        self.dp_rank, self.k, self.rng = dp_rank, k, rng
        self.seqs: dict[str, Seq] = {}
        self.pages: dict[str, list[int]] = {}
        self.target: dict[int, int] = {}  # slot -> content (a prefix hash, or GARBAGE)
        self.drafter: dict[int, int] = {}
        self.last: dict[str, int] = {}  # the last token emitted per request
        self.next_pos: dict[str, int] = {}  # where each request's next row starts
        self.results: deque[StepResult] = deque()
        self.floating = 0  # floating rows run

    def _slot(self, rid: str, pos: int) -> int:
        pages = self.pages[rid]
        assert pos < len(pages) * PS, f"{rid}: KV position {pos} beyond its pages"
        return pages[pos // PS] * PS + pos % PS

    def _check(self, kv: dict[int, int], rid: str, end: int, shift: int) -> None:
        """Attention over positions [0, end) reads the request's own prefixes (shift 1:
        the drafter's, each with the token after it)."""
        hashes = self.seqs[rid].hashes
        for p in range(end):
            assert kv.get(self._slot(rid, p)) == hashes[p + shift], (
                f"{rid}: {'drafter' if shift else 'target'} KV at {p} is not its content"
            )

    def run(self, plan: StepPlan) -> None:
        """Run this rank's batch: every row writes its KV, then reads it; the drafters'
        round the same way; the result is queued."""
        rb = plan.batches[self.dp_rank]
        for rid in rb.finished_rids:
            del self.seqs[rid], self.pages[rid]
        for new in rb.new_requests:
            drafts = self.k > 0 and verifies_drafts(new.sampling)
            self.seqs[new.rid], self.pages[new.rid] = Seq(list(new.prompt_ids), drafts), []
        ran = [self._target(row) for row in rb.rows]
        for r in ran:  # the target's logits at [start, end + a) give the emitted tokens
            self._check(self.target, r.rid, r.end + r.a, 0)
        for r in ran:
            if self.seqs[r.rid].drafts:
                self._draft(r)
        for r in ran:
            if self.seqs[r.rid].drafts:
                self._check(self.drafter, r.rid, r.end + r.a, 1)
        rows = []
        for r in ran:
            emitted = self.seqs[r.rid].tokens[r.end : r.end + r.a + 1] if r.sample else []
            rows.append(RowResult(r.rid, emitted, r.a))
        self.results.append(StepResult(plan.step_id, rows, self.dp_rank))

    def _target(self, row: ScheduledRow) -> Ran:
        """The target's KV of a row's inputs and drafts (garbage past the accepted)."""
        rid, seq = row.rid, self.seqs[row.rid]
        if row.reset:
            self.pages[rid] = []
        self.pages[rid] += row.new_pages
        start = row.start
        if row.drafts_in_flight:  # floating: where the row in flight ended
            start = self.next_pos[rid]
            assert row.start <= start <= row.start + row.drafts_in_flight
            self.floating += 1
        for j, tok in enumerate(row.input_ids):
            if tok == PLACEHOLDER:
                tok = self.last[rid]
            assert tok == seq.tokens[start + j], f"{rid}: input at {start + j} is {tok}"
            self.target[self._slot(rid, start + j)] = seq.hashes[start + j]
        end = start + len(row.input_ids)
        if not row.sample:
            assert not row.num_draft
            return Ran(rid, start, end, 0, 0, False)
        a = self.rng.randint(0, row.num_draft)  # the drafter is right a times
        seq.grow(end + a + 1)
        for i in range(row.num_draft):
            self.target[self._slot(rid, end + i)] = seq.hashes[end + i] if i < a else GARBAGE
        self.last[rid], self.next_pos[rid] = seq.tokens[end + a], end + a
        return Ran(rid, start, end, row.num_draft, a, True)

    def _draft(self, r: Ran) -> None:
        """The drafter's extend over every position the target computed, each with the
        token after it (garbage past the last accepted one), then, from a sampling
        row's last accepted position, k - 1 draft steps (garbage: never accepted KV)."""
        seq = self.seqs[r.rid]
        for p in range(r.start, r.end + r.d):
            self.drafter[self._slot(r.rid, p)] = seq.hashes[p + 1] if p < r.end + r.a else GARBAGE
        if r.sample:
            anchor = r.end - 1 + r.a
            for p in range(anchor + 1, min(anchor + self.k, MAX_LEN)):
                self.drafter[self._slot(r.rid, p)] = GARBAGE


# ---------------------------------------------------------------- traffic


@dataclass(frozen=True)
class Setup:
    """What a test run varies; the seed picks the rest (budgets, reserve, pool size)."""

    prefix_caching: bool = False
    k: int = 0  # draft slots per decode row
    inflight: int = 1
    floats: bool = False
    dp_size: int = 1
    num_pages: int = 0  # per DP rank; 0: the seed picks a small pool

    def __str__(self) -> str:
        s = f"{'cache' if self.prefix_caching else 'nocache'}-k{self.k}-in{self.inflight}"
        return s + ("-float" if self.floats else "") + (f"-dp{self.dp_size}" * (self.dp_size > 1))


REFERENCE = Setup(num_pages=400)


@dataclass
class Step:
    """What happens before one pump: requests arrive, then some are aborted."""

    arrivals: list[GenerateRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)


def sampling(rng: random.Random) -> SamplingParams:
    """A request's parameters: the stops, limits and kinds of request the policy tells apart."""
    kw: dict = {"max_tokens": rng.choice([1, 2, 5, 8, 12, 20, 30])}
    if rng.random() < 0.25:
        kw["ignore_eos"] = True
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [10 + rng.randrange(VOCAB)]
    if rng.random() < 0.1:
        kw["min_tokens"] = rng.randint(1, 4)
    if rng.random() < 0.1:
        kw["repetition_penalty"] = 1.1  # NOTE: such requests never draft
    if rng.random() < 0.05:
        kw["prompt_logprobs"] = 0  # NOTE: such requests never match cached pages
    return SamplingParams(**kw)


def traffic(seed: int) -> list[Step]:
    """The seed's arrivals and aborts, pump by pump."""
    rng = random.Random(seed)
    prefixes = [[10 + rng.randrange(VOCAB) for _ in range(rng.randint(1, 14))] for _ in range(3)]
    steps, rids, n = [], [], 0
    for t in range(TRAFFIC_STEPS):
        step = Step()
        if t == 0 or rng.random() < 0.35:
            prompt: list[int] = []
            for _ in range(rng.choice([1, 1, 2, 3, 5])):
                if not prompt or rng.random() < 0.6:  # else the same prompt again
                    prompt = rng.choice(prefixes) + [
                        10 + rng.randrange(VOCAB) for _ in range(rng.choice([0, 1, 3, 6, 12]))
                    ]
                step.arrivals.append(GenerateRequest(f"r{n}", prompt, sampling(rng)))
                rids.append(f"r{n}")
                n += 1
        if step.arrivals and rng.random() < 0.1:  # one that has just arrived: waiting
            step.aborts.append(rng.choice(step.arrivals).rid)
        if rids and rng.random() < 0.15:  # a recent one: often running, or preempted
            step.aborts.append(rng.choice(rids[-8:]))
        steps.append(step)
    return steps


@dataclass
class Outcome:
    """A run's outputs per request and how often it met what the test must exercise."""

    tokens: dict[str, list[int]]
    reasons: dict[str, str]
    evictions: int = 0
    preemptions: int = 0
    aborted_waiting: int = 0
    aborted_running: int = 0
    floating: int = 0


def run(seed: int, setup: Setup) -> Outcome:
    """The seed's traffic through a scheduler of `setup` and its fake workers, checked
    for integrity after every step and for every page back at the end."""
    rng = random.Random(f"{seed}/{setup}")
    # NOTE: pages for one request at the context length, the dummy page and one more
    least = -(-MAX_LEN // PS) + 2
    cfg = SchedulerConfig(
        num_pages=setup.num_pages or rng.randint(least + 1, least + 10),
        page_size=PS,
        max_model_len=MAX_LEN,
        max_num_seqs=rng.choice([2, 6]),
        max_num_batched_tokens=rng.choice([24, 48]),
        chunked_prefill_size=rng.choice([5, 12, 32]),
        eos_token_ids=(EOS,),
        check_invariants=True,
        max_inflight=setup.inflight,
        conservativeness=rng.choice([0.0, 0.5, 1.0]),
        dp_size=setup.dp_size,
        num_draft_tokens=setup.k,
        float_rows=setup.floats,
        prefix_caching=setup.prefix_caching,
        separate_prefill=rng.random() < 0.25,
    )
    s = Scheduler(cfg)
    workers = [ContentWorker(r, setup.k, rng) for r in range(setup.dp_size)]
    out = Outcome({}, {})

    def count_eviction(forget):
        def on_evict(page: int) -> None:
            out.evictions += 1
            forget(page)

        return on_evict

    for rs in s.ranks:
        if rs.cache is not None:
            rs.alloc.on_evict = count_eviction(rs.alloc.on_evict)

    def submit(plan: StepPlan) -> None:
        for w in workers:
            w.run(plan)
        for w, rb in zip(workers, plan.batches):  # the workers' page tables are the scheduler's
            for row in rb.rows:
                assert w.pages[row.rid] == s.requests[row.rid].pages, row.rid

    def receive() -> StepResult:
        return rng.choice([w for w in workers if w.results]).results.popleft()

    def take(outputs) -> None:
        for o in outputs:
            assert o.rid not in out.reasons, f"{o.rid}: output after its end"
            got = out.tokens.setdefault(o.rid, [])
            got += o.token_ids
            assert o.num_output_tokens == len(got)
            if o.finish_reason:
                out.reasons[o.rid] = o.finish_reason

    steps = traffic(seed)
    added = []
    for t in range(5000):
        if t < len(steps):
            for msg in steps[t].arrivals:
                s.add_request(msg)
                added.append(msg.rid)
            for rid in steps[t].aborts:
                req = s.requests.get(rid)
                if req is not None:
                    running = req in s.running
                    out.aborted_running += running
                    out.aborted_waiting += not running
                s.abort(rid)
        elif not s.has_work():
            break
        take(s.pump(submit, receive))
    take(s.take_outputs())
    assert not s.has_work() and not s.requests, "every request ends"
    assert sorted(out.reasons) == sorted(added), "every request ends exactly once"
    assert not any(w.seqs for w in workers), "the workers drop every request"
    s.check_integrity()
    assert s.num_free_pages == s.num_usable_pages  # evictable cached pages count as free
    out.preemptions = s.counters.preemptions
    out.floating = sum(w.floating for w in workers)
    return out


@functools.cache
def reference(seed: int) -> Outcome:
    """The seed's run without drafts, overlap, prefix caching or page pressure."""
    return run(seed, REFERENCE)


SETUPS = [
    Setup(prefix_caching=c, k=k, inflight=i, floats=f)
    for c in (False, True)
    for k, i, f in ((0, 1, False), (0, 2, False), (3, 1, False), (3, 2, False), (3, 2, True))
] + [Setup(True, 0, 2, dp_size=2), Setup(True, 3, 2, True, dp_size=2)]


@pytest.mark.parametrize("setup", SETUPS, ids=str)
def test_random_traffic_keeps_outputs_and_pages(setup: Setup):
    """Random traffic under page pressure, with aborts: every request ends once, every
    page comes back, every row reads only KV of its own content, and the outputs of the
    requests not aborted are those of the reference run. The seeds must have evicted
    cached pages, preempted and aborted waiting and running requests."""
    total: Counter[str] = Counter()
    for seed in SEEDS:
        ref, got = reference(seed), run(seed, setup)
        kept = [r for r in got.reasons if "abort" not in (got.reasons[r], ref.reasons[r])]
        for rid in kept:
            assert (got.tokens[rid], got.reasons[rid]) == (ref.tokens[rid], ref.reasons[rid]), (
                f"seed {seed}: {rid}"
            )
        total.update(
            kept=len(kept), evictions=got.evictions, preemptions=got.preemptions,
            aborted_waiting=got.aborted_waiting, aborted_running=got.aborted_running,
            floating=got.floating,
        )  # fmt: skip
    assert total["kept"] > 10 * len(SEEDS)
    assert total["preemptions"] > 0 and total["aborted_waiting"] > 0
    assert total["aborted_running"] > 0
    assert (total["evictions"] > 0) == setup.prefix_caching
    assert (total["floating"] > 0) == setup.floats
