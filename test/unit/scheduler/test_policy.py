from collections import deque

from gyrfalcon.ipc.messages import SamplingParams
from gyrfalcon.scheduler.page_allocator import PageAllocator
from gyrfalcon.scheduler.policy import Limits, pages_needed, schedule
from gyrfalcon.scheduler.request import Request, Status


def req(rid, n_prompt, arrival):
    return Request(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=100), arrival)


def advance(decision, token=7):
    """What the scheduler does with a result: computed += n, sampled rows get a token."""
    for s in decision.rows:
        r = s.req
        r.num_computed += s.num_tokens
        if s.samples:
            r.output_ids.append(token)


def test_pages_needed():
    assert pages_needed(0, 1, 4) == 1
    assert pages_needed(0, 4, 4) == 1
    assert pages_needed(1, 5, 4) == 1
    assert pages_needed(2, 5, 4) == 0
    assert pages_needed(0, 0, 4) == 0


def test_token_budget_and_chunking_of_a_long_prompt():
    alloc = PageAllocator(64)
    limits = Limits(max_num_batched_tokens=16, chunked_prefill_size=10, max_num_seqs=8, page_size=4)
    a = req("a", 25, 0)
    running, waiting = [], deque([a])
    chunks = []
    while not a.output_ids:
        d = schedule(running, waiting, alloc, limits)
        assert d.num_tokens <= 16
        chunks.append((d.rows[0].num_tokens, d.rows[0].samples))
        advance(d)
    assert chunks == [(10, False), (10, False), (5, True)]
    assert len(a.pages) == pages_needed(0, 25, 4)
    alloc.check_integrity([a.pages])


def test_decodes_first_then_prefill_within_budget():
    alloc = PageAllocator(64)
    limits = Limits(max_num_batched_tokens=8, chunked_prefill_size=8, max_num_seqs=8, page_size=4)
    a, b = req("a", 3, 0), req("b", 20, 1)
    running, waiting = [], deque([a])
    advance(schedule(running, waiting, alloc, limits))  # a prefilled, sampled
    waiting.append(b)
    d = schedule(running, waiting, alloc, limits)
    assert [(s.req.rid, s.num_tokens) for s in d.rows] == [("a", 1), ("b", 7)]
    assert d.num_tokens == 8


def test_max_num_seqs_limits_admission():
    alloc = PageAllocator(64)
    limits = Limits(100, 100, max_num_seqs=2, page_size=4)
    rs = [req(str(i), 3, i) for i in range(4)]
    running, waiting = [], deque(rs)
    d = schedule(running, waiting, alloc, limits)
    assert [s.req.rid for s in d.rows] == ["0", "1"]
    assert [r.rid for r in waiting] == ["2", "3"]


def test_admission_waits_for_pages_of_whole_prompt():
    alloc = PageAllocator(4)  # 3 usable pages of 4 tokens
    limits = Limits(100, 100, 8, page_size=4)
    big = req("big", 13, 0)  # needs 4 pages: never fits at once
    running, waiting = [], deque([big])
    d = schedule(running, waiting, alloc, limits)
    assert d.rows == [] and list(waiting) == [big]


def test_preemption_when_decode_needs_a_page():
    alloc = PageAllocator(3)  # 2 usable pages of 4 tokens
    limits = Limits(100, 100, 8, page_size=4)
    a, b = req("a", 4, 0), req("b", 3, 1)
    running, waiting = [], deque([a, b])
    advance(schedule(running, waiting, alloc, limits))
    assert alloc.num_free == 0 and a.output_ids and b.output_ids
    # a needs a 2nd page for position 4: b (newest) is preempted
    d = schedule(running, waiting, alloc, limits)
    assert [r.rid for r in d.preempted] == ["b"]
    assert b.status is Status.WAITING and b.pages == [] and b.num_computed == 0
    assert b.needs_reset and list(waiting) == [b]
    assert [(s.req.rid, s.num_tokens) for s in d.rows] == [("a", 1)]
    alloc.check_integrity([a.pages])
