from collections import deque

from gyrfalcon.ipc.messages import SamplingParams
from gyrfalcon.scheduler.page_allocator import PageAllocator
from gyrfalcon.scheduler.policy import (
    RESERVE_CLIP,
    Decision,
    Limits,
    ReserveRatio,
    pages_needed,
    reserved_tokens,
    row_end,
    schedule,
)
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


def test_separate_prefill_steps_never_hold_prefill_and_decode_rows_together():
    """--separate-prefill-steps: the arriving prompt's chunks run in steps of their own
    (with the whole token budget), the running request's decodes wait for them, then
    both decode together."""
    alloc = PageAllocator(64)
    limits = Limits(
        max_num_batched_tokens=8,
        chunked_prefill_size=8,
        max_num_seqs=8,
        page_size=4,
        separate_prefill=True,
    )
    a, b = req("a", 3, 0), req("b", 12, 1)
    running, waiting = [], deque([a])
    advance(schedule(running, waiting, alloc, limits))  # a prefilled, sampled
    advance(schedule(running, waiting, alloc, limits))  # a decodes: nothing to prefill
    waiting.append(b)
    steps = []
    for _ in range(3):
        d = schedule(running, waiting, alloc, limits)
        steps.append([(s.req.rid, s.num_tokens) for s in d.rows])
        advance(d)
    assert steps == [[("b", 8)], [("b", 4)], [("a", 1), ("b", 1)]]
    assert a.output_ids == [7, 7, 7] and b.output_ids == [7, 7]
    alloc.check_integrity([a.pages, b.pages])


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


def test_a_row_in_flight_that_may_emit_many_tokens_blocks_the_next_decode():
    """Overlap rule: a request is planned again before its result is in only when its
    row in flight emits exactly one token (its next position is then known)."""
    alloc = PageAllocator(64)
    limits = Limits(100, 100, 8, page_size=4, num_draft=3)
    a, b = req("a", 4, 0), req("b", 4, 1)
    running, waiting = [], deque([a, b])
    advance(schedule(running, waiting, alloc, limits))  # both prefilled and sampled
    d = schedule(running, waiting, alloc, limits)
    assert [(s.req.rid, s.num_tokens, s.num_draft) for s in d.rows] == [("a", 1, 3), ("b", 1, 3)]
    assert len(a.pages) * 4 >= 5 + 3  # KV for the input and the three drafts
    for s in d.rows:  # the plan is out (Scheduler.build_plan's effect), results are not
        s.req.num_computed += 1
        s.req.num_pending += 1
    a.num_pending_drafts = 3  # a's row in flight may emit 1..4 tokens
    b.num_pending_drafts = 0  # b stands for a row in flight without drafts: one token
    d = schedule(running, waiting, alloc, limits)
    assert [s.req.rid for s in d.rows] == ["b"]  # b's next input is its one pending token
    alloc.check_integrity([a.pages, b.pages])


def long_req(rid, n_prompt, arrival, max_tokens):
    return Request(rid, [3] * n_prompt, SamplingParams(max_tokens=max_tokens), arrival)


def test_admission_keeps_room_for_running_outputs():
    limits = Limits(100, 100, 8, page_size=4)
    for ratio, admitted in [(0.0, ["a", "b"]), (0.5, ["a"])]:
        alloc = PageAllocator(9)  # 8 usable pages = 32 tokens
        a, b = long_req("a", 8, 0, max_tokens=24), long_req("b", 8, 1, max_tokens=24)
        running, waiting = [], deque([a, b])
        d = schedule(running, waiting, alloc, limits, reserve_ratio=ratio)
        # b's prompt (2 pages) fits in the 6 free pages, but not beside a reserve of
        # 0.5 x 24 tokens (3 pages) for a plus 3 pages for b itself
        assert [s.req.rid for s in d.rows] == admitted


def test_admission_reserve_never_blocks_an_idle_engine():
    alloc = PageAllocator(5)  # 16 tokens
    limits = Limits(100, 100, 8, page_size=4)
    a = long_req("a", 8, 0, max_tokens=1000)  # its reserve alone would be 700 tokens
    running, waiting = [], deque([a])
    d = schedule(running, waiting, alloc, limits, reserve_ratio=0.7)
    assert [s.req.rid for s in d.rows] == ["a"]


def test_admission_reserve_is_clipped_for_huge_max_tokens():
    r = long_req("a", 8, 0, max_tokens=10**9)
    assert reserved_tokens(r, 0.5) == RESERVE_CLIP // 2
    r.output_ids = [1] * 10
    assert reserved_tokens(long_req("b", 8, 0, max_tokens=30), 1.0) == 30
    done = long_req("c", 8, 0, max_tokens=5)
    done.output_ids = [1] * 5
    assert reserved_tokens(done, 1.0) == 0


def test_reserve_ratio_relaxes_while_nothing_is_preempted_and_resets_on_preemption():
    ratio = ReserveRatio(init=0.7, floor=0.1, decay=0.25)
    busy = Decision(rows=[object()])
    for want in (0.45, 0.2, 0.1, 0.1):
        ratio.update(busy)
        assert abs(ratio.value - want) < 1e-9
    ratio.update(Decision())  # an empty step changes nothing
    assert abs(ratio.value - 0.1) < 1e-9
    ratio.update(Decision(rows=[object()], preempted=[object()]))
    assert ratio.value == 0.7


def test_spec_rows_hold_pages_for_the_drafters_lookahead_and_penalized_rows_draft_nothing():
    """A sampling row of a drafting request holds KV up to its last draft plus the
    drafter's k - 1 lookahead positions (capped at the context length); a request with
    penalties decodes one token per step and holds no draft positions."""
    alloc = PageAllocator(64)
    limits = Limits(100, 100, 8, page_size=4, num_draft=3, draft_lookahead=2)
    a = req("a", 4, 0)
    p = Request("p", [3] * 4, SamplingParams(max_tokens=20, repetition_penalty=1.2), 1)
    running, waiting = [], deque([a, p])
    d = schedule(running, waiting, alloc, limits)
    # prefill sampling rows: positions 0..3 plus lookahead 2 for a; p has no lookahead
    assert [len(s.req.pages) for s in d.rows] == [pages_needed(0, 6, 4), pages_needed(0, 4, 4)]
    advance(d)
    d = schedule(running, waiting, alloc, limits)
    assert [(s.req.rid, s.num_draft) for s in d.rows] == [("a", 3), ("p", 0)]
    # a: input at 4, drafts at 5..7, lookahead 8..9 -> 10 positions; p: position 4
    assert len(a.pages) == pages_needed(0, 10, 4) and len(p.pages) == pages_needed(0, 5, 4)
    capped = Limits(100, 100, 8, page_size=4, max_model_len=7, num_draft=3, draft_lookahead=2)
    assert row_end(req("c", 4, 2), 4, 0, capped) == 6
    c = req("c", 6, 3)
    assert row_end(c, 6, 0, capped) == 7  # never past the context length
    alloc.check_integrity([a.pages, p.pages])
