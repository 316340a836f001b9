"""Prefix caching: the tree of cached pages, the allocator's evictable pages, and the
scheduler admitting requests on cached prefixes (fake worker)."""

import pytest

from gyrfalcon.ipc.messages import GenerateRequest, RowResult, SamplingParams, StepResult
from gyrfalcon.scheduler.page_allocator import PageAllocator
from gyrfalcon.scheduler.prefix_cache import PrefixCache, cacheable_pages
from gyrfalcon.scheduler.request import Request, Status
from gyrfalcon.scheduler.scheduler import Scheduler, SchedulerConfig

P = 4  # page size
EOS = 99


def computed(tokens: list[int], cache: PrefixCache, rid: str = "a") -> Request:
    """A request that computed every position of `tokens` but the last, in fresh
    pages (after its cached prefix), inserted into the cache."""
    req = Request(rid, list(tokens), SamplingParams(max_tokens=4), arrival=0)
    cache.acquire(req)
    need = -(-len(tokens) // P) - len(req.pages)
    req.pages += cache.alloc.alloc(need)
    req.num_computed = len(tokens) - 1
    req.status = Status.RUNNING
    cache.insert(req)
    return req


def test_cacheable_pages_need_the_next_token():
    assert cacheable_pages(8, 9, P) == 2  # positions 0..7 computed, token 8 known
    assert cacheable_pages(8, 8, P) == 1  # token 8 unknown: page 1's last KV is not final
    assert cacheable_pages(7, 20, P) == 1  # position 7 not computed yet
    assert cacheable_pages(0, 1, P) == 0


def test_a_shared_prefix_is_matched_page_by_page_and_leaves_a_token_to_compute():
    alloc = PageAllocator(16)
    cache = PrefixCache(alloc, P)
    a = computed(list(range(1, 12)), cache)  # 11 tokens: pages 0, 1 cacheable (8 <= 10)
    assert cache.num_pages == 2
    b = Request("b", list(range(1, 10)) + [50, 51], SamplingParams(), arrival=1)
    assert cache.acquire(b) == 8 and b.pages == a.pages[:2] and b.num_computed == 8
    # the same 9 tokens alone: page 1 would leave nothing to compute, so one page
    c = Request("c", list(range(1, 10)), SamplingParams(), arrival=2)
    assert cache.acquire(c) == 8  # 9 tokens: page 1 ends at 8 and token 8 is left
    d = Request("d", list(range(1, 9)), SamplingParams(), arrival=3)
    assert cache.acquire(d) == 4  # 8 tokens: token 8 unknown, so page 1 does not match
    alloc.check_integrity([a.pages, b.pages, c.pages, d.pages])
    cache.check_integrity()


def test_the_token_after_a_page_is_part_of_its_key():
    """The drafter's KV of a page's last position depends on the next token."""
    cache = PrefixCache(PageAllocator(16), P)
    computed([1, 2, 3, 4, 5, 6, 7], cache)
    other = Request("o", [1, 2, 3, 4, 9, 9, 9], SamplingParams(), arrival=1)
    assert cache.acquire(other) == 0 and other.pages == []
    same = Request("s", [1, 2, 3, 4, 5, 0, 0], SamplingParams(), arrival=2)
    assert cache.acquire(same) == 4


def test_with_a_drafter_requests_that_do_not_draft_never_insert():
    """Penalties turn drafting off, so such a request's pages lack the drafter's KV."""
    cache = PrefixCache(PageAllocator(16), P, drafter_kv=True)
    req = Request("p", list(range(1, 12)), SamplingParams(repetition_penalty=1.2), arrival=0)
    req.pages, req.num_computed = cache.alloc.alloc(3), 10
    cache.insert(req)
    assert cache.num_pages == 0
    computed(list(range(1, 12)), cache)  # a drafting request's pages do go in
    assert cache.num_pages == 2
    other = Request("o", list(range(1, 12)), SamplingParams(repetition_penalty=1.2), arrival=1)
    assert cache.acquire(other) == 8  # and one that does not draft may use them


def test_prompt_logprobs_never_match():
    cache = PrefixCache(PageAllocator(16), P)
    computed(list(range(1, 12)), cache)
    req = Request("r", list(range(1, 12)), SamplingParams(prompt_logprobs=1), arrival=1)
    assert cache.acquire(req) == 0 and req.pages == []


def test_released_pages_are_free_to_allocate_and_evicted_deepest_first():
    alloc = PageAllocator(9)  # 8 usable pages
    cache = PrefixCache(alloc, P)
    a = computed(list(range(1, 14)), cache)  # 4 pages, 3 cacheable
    b = computed(list(range(101, 114)), cache, "b")
    alloc.free(a.pages)
    alloc.free(b.pages)
    assert alloc.num_free == 8 and alloc.num_evictable == 6 and cache.num_pages == 6
    alloc.check_integrity([])
    # 2 pages free (the uncached last pages), then the oldest evictable one: a was
    # released first, and within a its deepest page counts as released first
    got = alloc.alloc(3)
    assert cache.num_pages == 5
    probe = Request("p", list(range(1, 14)), SamplingParams(), arrival=2)
    assert cache.acquire(probe) == 8  # a's first two pages survive
    cache.release(probe)
    alloc.free(got)
    cache.check_integrity()
    alloc.check_integrity([])


def test_evicting_a_page_takes_its_descendants():
    alloc = PageAllocator(6)  # 5 usable pages
    cache = PrefixCache(alloc, P)
    a = computed(list(range(1, 18)), cache)  # 5 pages, 4 cacheable
    root, child = a.pages[0], a.pages[1]
    alloc.free(a.pages)
    alloc.evict(root)
    assert cache.num_pages == 0 and alloc.num_evictable == 0 and alloc.num_free == 5
    assert child not in alloc.held
    cache.check_integrity()
    alloc.check_integrity([])


def test_content_computed_twice_side_by_side_keeps_one_cached_copy():
    alloc = PageAllocator(16)
    cache = PrefixCache(alloc, P)
    tokens = list(range(1, 12))
    a = Request("a", tokens, SamplingParams(), arrival=0)
    b = Request("b", tokens, SamplingParams(), arrival=1)
    for r in (a, b):  # both admitted before either inserted
        cache.acquire(r)
        r.pages = alloc.alloc(3)
        r.num_computed, r.status = 10, Status.RUNNING
    cache.insert(a)
    cache.insert(b)
    assert cache.num_pages == 2 and b.num_cache_pages == 2
    alloc.free(b.pages)  # b's copies are its own: back to the free list
    assert alloc.num_evictable == 0
    alloc.check_integrity([a.pages])
    cache.check_integrity()


def test_eviction_with_a_live_user_of_a_descendant():
    """A duplicate parent: b holds its own copy of page 0 but its page 1 is cached under
    a's page 0. Evicting a's page 0 uncaches b's page 1 without freeing it."""
    alloc = PageAllocator(16)
    cache = PrefixCache(alloc, P)
    tokens = list(range(1, 14))
    a = Request("a", tokens[:6], SamplingParams(), arrival=0)
    b = Request("b", tokens, SamplingParams(), arrival=1)
    for r, n in ((a, 2), (b, 4)):
        cache.acquire(r)
        r.pages = alloc.alloc(n)
        r.num_computed, r.status = len(r.prompt_ids) - 1, Status.RUNNING
    cache.insert(a)  # a's page 0
    cache.insert(b)  # b's page 0 is a duplicate; b's pages 1, 2 hang under a's page 0
    assert cache.num_pages == 3
    alloc.free(a.pages)
    alloc.evict(a.pages[0])
    assert cache.num_pages == 0
    alloc.check_integrity([b.pages])
    cache.check_integrity()
    # b goes on: its chain hung under an evicted node, so it starts again at the root
    # and its own copies become the cached ones (train-eagle3 writing 48,000 instructions
    # from one prompt met the dangling node: a KeyError in the scheduler)
    b.pages += alloc.alloc(1)
    b.prompt_ids += [14, 15, 16, 17]
    b.num_computed = 16
    cache.insert(b)
    assert cache.num_pages == 4 and b.num_cache_pages == 4
    probe = Request("p", b.prompt_ids + [18], SamplingParams(), arrival=2)
    assert cache.acquire(probe) == 16 and probe.pages == b.pages[:4]
    cache.release(probe)
    alloc.check_integrity([b.pages])
    cache.check_integrity()


# ---------------------------------------------------------------- the scheduler


def make(num_pages=16, prefix_caching=True):
    cfg = SchedulerConfig(num_pages, P, 64, 8, 64, 64, (EOS,), True, prefix_caching=prefix_caching)
    return Scheduler(cfg)


def run(s: Scheduler, outputs: dict[str, list[int]]) -> list:
    """Steps until idle, each sampling row answered from outputs[rid] in order; the
    rows of every plan."""
    rows = []
    while s.has_work():
        plan = s.build_plan()
        if plan is None:
            break
        batch = plan.batches[0]
        rows += batch.rows
        results = [
            RowResult(r.rid, [outputs[r.rid].pop(0)] if r.sample else []) for r in batch.rows
        ]
        s.process_result(StepResult(plan.step_id, results))
    return rows


def test_a_second_turn_starts_after_the_first_turns_pages():
    s = make()
    first = list(range(1, 11))  # 10 prompt tokens
    s.add_request(GenerateRequest("t1", first, SamplingParams(max_tokens=3)))
    run(s, {"t1": [20, 21, EOS]})
    assert s.num_free_pages == s.num_usable_pages
    # the second turn: the first prompt, the answer, a new question
    second = first + [20, 21, EOS] + [30, 31, 32]
    s.add_request(GenerateRequest("t2", second, SamplingParams(max_tokens=2)))
    rows = run(s, {"t2": [40, EOS]})
    first_row = rows[0]
    # computed: 10 prompt + 2 outputs (EOS never computed) = 12 positions; token 12 known
    assert first_row.start == 12 and len(first_row.new_pages) == 4
    assert first_row.input_ids == second[12:]
    s.check_integrity()
    assert s.num_free_pages == s.num_usable_pages
    stats = s.stats(0)
    assert stats.prefix_cache_hits == 12 and stats.prefix_cache_queries == 10 + 16


def test_cached_tokens_are_reported_once_admitted():
    s = make()
    s.add_request(GenerateRequest("a", list(range(1, 14)), SamplingParams(max_tokens=1)))
    run(s, {"a": [EOS]})
    s.add_request(GenerateRequest("b", list(range(1, 14)) + [7], SamplingParams(max_tokens=1)))
    plan = s.build_plan()
    out = s.process_result(StepResult(plan.step_id, [RowResult("b", [EOS])]))
    assert out[0].num_cached_tokens == 12 and out[0].finish_reason == "stop"


def test_disabled_prefix_caching_recomputes():
    s = make(prefix_caching=False)
    s.add_request(GenerateRequest("a", list(range(1, 14)), SamplingParams(max_tokens=1)))
    run(s, {"a": [EOS]})
    s.add_request(GenerateRequest("b", list(range(1, 14)), SamplingParams(max_tokens=1)))
    assert run(s, {"b": [EOS]})[0].start == 0


@pytest.mark.parametrize("num_pages", [6, 9])
def test_pressure_evicts_and_every_request_finishes(num_pages):
    """Many prompts sharing a prefix through a tiny pool: evictions, preemptions,
    every request ends and every page comes back."""
    s = make(num_pages)
    shared = list(range(1, 9))
    outputs = {}
    for i in range(12):
        s.add_request(GenerateRequest(f"r{i}", shared + [100 + i] * (i % 5 + 1),
                                      SamplingParams(max_tokens=3, ignore_eos=True)))  # fmt: skip
        outputs[f"r{i}"] = [50 + i] * 20  # NOTE: enough for recomputes after preemption
    run(s, outputs)
    assert not s.requests
    s.check_integrity()
    assert s.num_free_pages == s.num_usable_pages
    assert s.stats(0).prefix_cache_hits > 0


def test_identical_prompts_side_by_side_then_their_cached_copy_evicted():
    """The same prompt twice at once (how train-eagle3 asks for instructions): b
    computes its own copy of a's pages and chains on under a's. a ends, another prompt
    takes a's cached pages, and b goes on decoding past a page boundary."""
    s = make(12)  # 11 usable pages
    prompt = list(range(1, 10))
    s.add_request(GenerateRequest("a", prompt, SamplingParams(max_tokens=1)))
    s.add_request(GenerateRequest("b", prompt, SamplingParams(max_tokens=12, ignore_eos=True)))
    plan = s.build_plan()
    assert [r.rid for r in plan.batches[0].rows] == ["a", "b"]  # side by side
    s.process_result(StepResult(plan.step_id, [RowResult("a", [EOS]), RowResult("b", [70])]))
    s.add_request(GenerateRequest("x", list(range(200, 220)), SamplingParams(max_tokens=2)))
    run(s, {"b": [70] * 11, "x": [71, EOS]})
    assert not s.requests
    s.check_integrity()
    assert s.num_free_pages == s.num_usable_pages
    # b's own copies of the prompt's pages are cached now
    s.add_request(GenerateRequest("c", prompt + [70] * 4, SamplingParams(max_tokens=1)))
    assert run(s, {"c": [EOS]})[0].start == 12


def test_evicting_the_root_of_a_long_generation():
    """A node with thousands of cached pages under it (a long answer, one token a
    page here) goes with all of them; the eviction recursed once per page before."""
    n = 3000
    alloc = PageAllocator(n + 2)
    cache = PrefixCache(alloc, 1)
    a = Request("a", list(range(1, n + 2)), SamplingParams(), arrival=0)
    a.pages, a.num_computed = alloc.alloc(n + 1), n + 1
    cache.insert(a)
    assert cache.num_pages == n
    alloc.free(a.pages)
    alloc.evict(a.pages[0])
    assert cache.num_pages == 0 and alloc.num_free == n + 1 and alloc.num_evictable == 0
    cache.check_integrity()
    alloc.check_integrity([])
