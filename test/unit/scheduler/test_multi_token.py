"""Rows that emit 1..k+1 tokens (speculative decoding's accounting), with a fake worker.

The fake worker plays a drafter + target pair over a 'model' that is a fixed
function of (request, position). A sampling row with d draft slots writes the KV
of its input and of d drafts; the first `a` drafts are right (a chosen by the
test: 0, k, or mixed), the rest are garbage, and the row emits the a accepted
drafts plus the target's token. KV is simulated per physical slot, so a row that
reads a position whose KV is not that request's true token (a rejected draft
never overwritten, a page reused too early) fails the test. Whatever the accept
counts, outputs must equal those of plain one-token decoding.
"""

from collections.abc import Callable

import pytest

from gyrfalcon.ipc.contract import PLACEHOLDER
from gyrfalcon.ipc.messages import (
    ForwardMode,
    GenerateRequest,
    RowResult,
    SamplingParams,
    StepResult,
)
from gyrfalcon.scheduler.policy import preempt
from gyrfalcon.scheduler.request import Status
from gyrfalcon.scheduler.scheduler import Scheduler, SchedulerConfig

EOS = 99
PS = 4  # page size
GARBAGE = -7  # what a rejected draft writes


def token(rid: str, pos: int) -> int:
    """The 'model': the token at position pos of request rid (EOS where a rid says so)."""
    stop_at = {"eos": 4 + 6, "stop42": 3 + 5}.get(rid)  # prompt length + outputs before it
    if stop_at is not None and pos == stop_at:
        return EOS if rid == "eos" else 42
    return 10 + (sum(map(ord, rid)) * 31 + pos * 17) % 80


Accept = Callable[[str, int, int], int]  # (rid, row start, drafts) -> accepted drafts


def accept_none(rid: str, start: int, d: int) -> int:
    return 0


def accept_all(rid: str, start: int, d: int) -> int:
    return d


def accept_mixed(rid: str, start: int, d: int) -> int:
    return (sum(map(ord, rid)) + start) % (d + 1)


class SpecSimWorker:
    def __init__(self, accept: Accept):
        self.accept = accept
        self.seqs: dict[str, list[int]] = {}  # the true tokens the worker has seen or made
        self.pages: dict[str, list[int]] = {}
        self.kv: dict[int, tuple[str, int, int]] = {}  # slot -> (rid, position, token)
        self.queue: list[StepResult] = []
        self.accepted: list[int] = []  # accept counts of every row with drafts
        self.resets = 0
        self.last: dict[str, int] = {}  # the last token emitted per request
        self.next_pos: dict[str, int] = {}  # where each request's next row starts
        self.floating = 0  # floating rows seen

    def _write(self, rid: str, pos: int, tok: int) -> None:
        pages = self.pages[rid]
        assert pos < len(pages) * PS, f"{rid}: KV position {pos} beyond its pages"
        self.kv[pages[pos // PS] * PS + pos % PS] = (rid, pos, tok)

    def _check_prefix(self, rid: str, end: int) -> None:
        """Attention over positions [0, end) reads only this request's true tokens."""
        pages, seq = self.pages[rid], self.seqs[rid]
        for p in range(end):
            got = self.kv.get(pages[p // PS] * PS + p % PS)
            assert got == (rid, p, seq[p]), f"{rid}: KV at {p} is {got}, want {seq[p]}"

    def submit(self, plan):
        assert len(plan.batches) == 1
        rb = plan.batches[0]
        for rid in rb.finished_rids:
            del self.seqs[rid], self.pages[rid]
        for new in rb.new_requests:
            self.seqs[new.rid], self.pages[new.rid] = list(new.prompt_ids), []
        if rb.forward_mode == ForwardMode.VERIFY:
            assert all(len(r.input_ids) == 1 and r.sample for r in rb.rows)
            assert any(r.num_draft for r in rb.rows)
        rows = []
        for row in rb.rows:
            rid, seq = row.rid, self.seqs[row.rid]
            if row.reset:
                self.pages[rid] = []
                self.resets += 1
            self.pages[rid] += row.new_pages
            start = row.start
            if row.drafts_in_flight:  # floating: where the row in flight ended
                start = self.next_pos[rid]
                assert row.start <= start <= row.start + row.drafts_in_flight
                assert row.num_draft and len(row.input_ids) == 1
                self.floating += 1
            for j, tok in enumerate(row.input_ids):
                pos = start + j
                if tok == PLACEHOLDER:
                    tok = self.last[rid]  # the last token the worker emitted for it
                assert tok == seq[pos], f"{rid}: input at {pos} is {tok}, not {seq[pos]}"
                self._write(rid, pos, tok)
            self._check_prefix(rid, start)
            end = start + len(row.input_ids)
            if not row.sample:
                assert not row.num_draft
                rows.append(RowResult(rid))
                continue
            a = self.accept(rid, start, row.num_draft) if row.num_draft else 0
            assert 0 <= a <= row.num_draft
            if row.num_draft:
                self.accepted.append(a)
            while len(seq) <= end + a:  # the true continuation (the drafter is right a times)
                seq.append(token(rid, len(seq)))
            for i in range(row.num_draft):  # drafts' KV: right for the accepted, else garbage
                self._write(rid, end + i, seq[end + i] if i < a else GARBAGE)
            emitted = seq[end : end + a + 1]
            self.last[rid] = emitted[-1]
            self.next_pos[rid] = end + a
            rows.append(RowResult(rid, emitted, a))
        self.queue.append(StepResult(plan.step_id, rows))

    def take(self):
        return self.queue.pop(0)


def run(
    requests, k, accept=accept_mixed, inflight=2, num_pages=64, max_model_len=64, cons=1.0,
    floats=False,
):  # fmt: skip
    cfg = SchedulerConfig(
        num_pages, PS, max_model_len, 8, 32, 8, (EOS,), True, inflight, cons, 1, k, floats
    )
    s = Scheduler(cfg)
    for rid, prompt, sp in requests:
        s.add_request(GenerateRequest(rid, prompt, sp))
    w = SpecSimWorker(accept)
    got: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    reasons = {}
    for _ in range(2000):
        if not s.has_work():
            break
        for out in s.pump(w.submit, w.take):
            got[out.rid].extend(out.token_ids)
            assert out.num_output_tokens == len(got[out.rid])
            if out.finish_reason:
                reasons[out.rid] = out.finish_reason
        for req in s.running:  # the accounting rule: always a token left to feed
            assert req.remaining >= 1, (req.rid, req.num_computed, req.num_tokens)
    assert not s.has_work() and not w.seqs, "the worker must drop every request"
    assert s.num_free_pages == s.num_usable_pages
    s.check_integrity()
    return got, reasons, w


REQUESTS = [
    ("eos", [1, 2, 3, 4], SamplingParams(max_tokens=20)),
    ("stop42", [5, 6, 7], SamplingParams(max_tokens=20, stop_token_ids=[42])),
    ("len7", [5, 6, 7], SamplingParams(max_tokens=7, ignore_eos=True)),
    ("long", list(range(1, 19)), SamplingParams(max_tokens=12, ignore_eos=True)),
    ("one", [3, 3], SamplingParams(max_tokens=1)),
    ("min", [4, 4, 4], SamplingParams(max_tokens=9, min_tokens=4, ignore_eos=True)),
]


@pytest.mark.parametrize("inflight,floats", [(1, False), (2, False), (2, True)])
@pytest.mark.parametrize("accept", [accept_none, accept_all, accept_mixed])
@pytest.mark.parametrize("k", [1, 3])
def test_outputs_do_not_depend_on_accept_counts(k, accept, inflight, floats):
    ref, ref_reasons, _ = run(REQUESTS, k=0, inflight=inflight)
    got, reasons, w = run(REQUESTS, k=k, accept=accept, inflight=inflight, floats=floats)
    assert (w.floating > 0) == floats  # floating rows ran, and only where allowed
    assert got == ref and reasons == ref_reasons
    assert ref_reasons == {
        "eos": "stop", "stop42": "stop", "len7": "length", "long": "length", "one": "length",
        "min": "length",
    }  # fmt: skip
    assert got["eos"][-1] == EOS and len(got["eos"]) == 7  # cut inside a run when k=3
    assert len(got["len7"]) == 7 and len(got["long"]) == 12 and len(got["one"]) == 1
    assert w.accepted and max(w.accepted) <= k


@pytest.mark.parametrize("floats", [False, True])
def test_context_limit_inside_an_accepted_run(floats):
    sp = SamplingParams(max_tokens=50, ignore_eos=True)
    got, reasons, w = run(
        [("r", [1, 2, 3, 4], sp)], k=3, accept=accept_all, max_model_len=11, floats=floats
    )
    assert reasons == {"r": "length"} and len(got["r"]) == 7  # 4 + 7 == max_model_len


@pytest.mark.parametrize("floats", [False, True])
def test_preemption_of_requests_with_multi_token_rows_in_flight(floats):
    reqs = [
        (f"p{i}", list(range(1 + i, 9 + i)), SamplingParams(max_tokens=22, ignore_eos=True))
        for i in range(4)
    ]
    ref, _, _ = run(reqs, k=0, num_pages=64)
    got, reasons, w = run(reqs, k=3, accept=accept_mixed, num_pages=12, cons=0.0, floats=floats)
    assert w.resets > 0 and got == ref and set(reasons.values()) == {"length"}
    assert (w.floating > 0) == floats


def make(k=3, inflight=2, num_pages=32, max_model_len=64, floats=False):
    cfg = SchedulerConfig(
        num_pages, PS, max_model_len, 8, 64, 8, (EOS,), True, inflight, 1.0, 1, k, floats
    )
    return Scheduler(cfg)


def answer(s, plan, emitted: dict[str, list[int]]):
    """Process plan's result, each sampling row emitting emitted[rid] (len - 1 accepted)."""
    rows = [
        RowResult(r.rid, emitted[r.rid], len(emitted[r.rid]) - 1) if r.sample else RowResult(r.rid)
        for r in plan.batches[0].rows
    ]
    return s.process_result(StepResult(plan.step_id, rows))


def prefill_both(s):
    s.add_request(GenerateRequest("a", [1, 2, 3], SamplingParams(max_tokens=20)))
    s.add_request(GenerateRequest("b", [4, 5, 6, 7, 8], SamplingParams(max_tokens=20)))
    plan = s.build_plan()
    assert [r.num_draft for r in plan.batches[0].rows] == [0, 0]  # prefill rows verify nothing
    answer(s, plan, {"a": [10], "b": [20]})


def test_mixed_accept_counts_in_one_batch():
    s = make(k=3, inflight=1)
    prefill_both(s)
    plan = s.build_plan()
    rb = plan.batches[0]
    assert rb.forward_mode == ForwardMode.VERIFY
    assert [(r.rid, r.start, r.input_ids, r.num_draft) for r in rb.rows] == [
        ("a", 3, [10], 3),
        ("b", 5, [20], 3),
    ]
    a, b = s.requests["a"], s.requests["b"]
    assert len(a.pages) * PS >= 3 + 1 + 3  # pages for the input and the 3 drafts
    out = answer(s, plan, {"a": [11], "b": [21, 22, 23, 24]})  # 0 and 3 accepted
    assert [(o.rid, o.token_ids) for o in out] == [("a", [11]), ("b", [21, 22, 23, 24])]
    assert (a.num_computed, a.num_tokens) == (4, 5) and a.in_decode
    assert (b.num_computed, b.num_tokens) == (9, 10) and b.in_decode
    rows = s.build_plan().batches[0].rows
    assert [(r.rid, r.start, r.input_ids) for r in rows] == [("a", 4, [11]), ("b", 9, [24])]
    s.check_integrity()


def test_stop_inside_an_accepted_run_drops_the_rest():
    s = make(k=3, inflight=1)
    prefill_both(s)
    plan = s.build_plan()
    out = answer(s, plan, {"a": [11, EOS, 12, 13], "b": [21, 22]})
    by_rid = {o.rid: o for o in out}
    assert by_rid["a"].token_ids == [11, EOS] and by_rid["a"].finish_reason == "stop"
    assert by_rid["a"].num_output_tokens == 3  # 10, 11, EOS: 12 and 13 never counted
    assert by_rid["a"].num_accepted == 1 and by_rid["b"].num_accepted == 1
    assert by_rid["b"].token_ids == [21, 22] and by_rid["b"].finish_reason is None
    assert "a" not in s.requests
    plan = s.build_plan()
    assert plan.batches[0].finished_rids == ["a"]
    s.check_integrity()


def test_max_tokens_reached_mid_run():
    s = make(k=3, inflight=1)
    s.add_request(GenerateRequest("r", [1, 2], SamplingParams(max_tokens=3, ignore_eos=True)))
    answer(s, s.build_plan(), {"r": [10]})
    plan = s.build_plan()
    # two tokens left, still k drafts (a uniform row): what passes max_tokens is dropped
    assert plan.batches[0].rows[0].num_draft == 3
    out = answer(s, plan, {"r": [11, 12, 13, 14]})
    assert out[0].token_ids == [11, 12] and out[0].finish_reason == "length"
    assert out[0].num_output_tokens == 3
    assert (out[0].num_verify_steps, out[0].num_accepted) == (1, 1)  # as far as emitted
    assert s.num_free_pages == s.num_usable_pages


def test_drafts_stop_only_at_the_end_of_the_context():
    """Near max_model_len a row gets only the drafts whose KV fits the context."""
    s = make(k=3, inflight=1, max_model_len=8)
    s.add_request(GenerateRequest("r", [1, 2, 3, 4], SamplingParams(max_tokens=20)))
    answer(s, s.build_plan(), {"r": [10]})  # 5 tokens: room for the input and 2 drafts
    plan = s.build_plan()
    assert plan.batches[0].rows[0].num_draft == 2
    out = answer(s, plan, {"r": [11, 12, 13]})
    assert out[0].token_ids == [11, 12, 13] and out[0].finish_reason == "length"
    s.check_integrity()


def test_overlap_rule_no_new_row_while_a_multi_token_row_is_in_flight():
    for k, planned_again in ((0, True), (2, False)):
        s = make(k=k, inflight=2)
        s.add_request(GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=20)))
        p1 = s.build_plan()  # the prefill samples the first token
        answer(s, p1, {"r": [10]})
        p2 = s.build_plan()  # a decode (k=0) or verify (k=2) row is in flight
        assert s.may_plan() and s.requests["r"].num_pending_drafts == k
        p3 = s.build_plan()
        assert (p3 is not None) == planned_again
        if planned_again:  # its one token in flight stands in as PLACEHOLDER
            row = p3.batches[0].rows[0]
            assert row.start == 4 and row.input_ids == [PLACEHOLDER]
        else:
            answer(s, p2, {"r": [11, 12, 13]})  # both drafts accepted
            row = s.build_plan().batches[0].rows[0]
            assert row.start == 6 and row.input_ids == [13] and row.num_draft == 2


def test_a_floating_row_holds_pages_for_its_latest_start_and_the_bound_closes():
    """With floating rows the verify row in flight does not block the next one: it goes
    out at the lower bound with drafts_in_flight, pages for every draft accepted; the
    result's accept count makes num_computed exact again."""
    s = make(k=2, inflight=2, floats=True)
    s.add_request(GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=20)))
    answer(s, s.build_plan(), {"r": [10]})
    p2 = s.build_plan()  # verify row at 3: input 10, drafts at 4, 5
    p3 = s.build_plan()
    row, req = p3.batches[0].rows[0], s.requests["r"]
    assert (row.start, row.input_ids, row.num_draft, row.drafts_in_flight) == (
        4, [PLACEHOLDER], 2, 2,
    )  # fmt: skip
    # latest start 6: its input and 2 drafts at 6..8, the drafter's lookahead at 9
    assert len(req.pages) * PS >= 10
    answer(s, p2, {"r": [11, 12, 13]})  # both drafts accepted: p3's row starts at 6
    assert (req.num_computed, req.num_tokens) == (7, 8)  # 6 computed by p2 + p3's input
    answer(s, p3, {"r": [14]})
    row = s.build_plan().batches[0].rows[0]
    assert (row.start, row.input_ids, row.drafts_in_flight) == (7, [14], 0)
    s.check_integrity()


def test_no_floating_row_where_it_could_pass_max_tokens_or_hold_min_tokens():
    # max_tokens 6: if both drafts in flight were accepted, two tokens would be left,
    # so the next row would get one draft where planning after the result may give two
    for sp in (SamplingParams(max_tokens=6), SamplingParams(max_tokens=20, min_tokens=6)):
        s = make(k=2, inflight=2, floats=True)
        s.add_request(GenerateRequest("r", [1, 2, 3], sp))
        answer(s, s.build_plan(), {"r": [10]})
        s.build_plan()  # a verify row in flight with 2 drafts: up to 4 generated
        assert s.build_plan() is None  # wait for its accept count


@pytest.mark.parametrize("how", ["abort", "preempt"])
def test_abort_or_preemption_with_a_verify_row_in_flight_frees_every_page(how):
    s = make(k=3, inflight=2)
    s.add_request(GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=20)))
    answer(s, s.build_plan(), {"r": [10]})
    plan = s.build_plan()
    req = s.requests["r"]
    assert plan.batches[0].rows[0].num_draft == 3 and req.pages
    if how == "abort":
        s.abort("r")
        assert s.take_outputs()[0].finish_reason == "abort"
    else:
        rs = s.ranks[req.dp_rank]
        preempt(req, rs.alloc, rs.running, rs.waiting)
    s.check_integrity()
    assert s.num_free_pages == s.num_usable_pages
    out = answer(s, plan, {"r": [11, 12, 13, 14]})  # the row's result comes in anyway
    s.check_integrity()
    assert s.num_free_pages == s.num_usable_pages
    if how == "abort":
        assert out == [] and "r" not in s.requests
        assert s.build_plan().batches[0].finished_rids == ["r"]
        return
    # preempted: the tokens count, nothing is computed, and it is recomputed from 0
    assert out[0].token_ids == [11, 12, 13, 14]
    assert req.status is Status.WAITING and req.num_computed == 0 and not req.num_pending
    row = s.build_plan().batches[0].rows[0]
    assert row.reset and row.start == 0 and row.input_ids == [1, 2, 3, 10, 11, 12, 13, 14]
