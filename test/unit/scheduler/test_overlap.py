"""Overlap scheduling: plans go out before the previous result is back.

A simulated worker runs the plans in order like the real one: it substitutes
PLACEHOLDER inputs with the id it sampled last for that request, checks that
every input id is the token the sequence really has at that position, and
samples a token that is a fixed function of (request, position). Outputs with
two plans in flight must equal those with one, whatever stops a request.
"""

import pytest

from gyrfalcon.ipc.contract import PLACEHOLDER
from gyrfalcon.ipc.messages import GenerateRequest, RowResult, SamplingParams, StepResult
from gyrfalcon.scheduler.scheduler import Scheduler, SchedulerConfig

EOS = 99


def token(rid: str, pos: int) -> int:
    """The 'model': the token at position pos of request rid (EOS where a rid says so)."""
    stop_at = {"eos5": 5 + 4, "eos1": 1 + 3}.get(rid)  # prompt length + outputs before EOS
    if stop_at is not None and pos == stop_at:
        return EOS
    return 10 + (sum(map(ord, rid)) * 31 + pos * 17) % 80


class SimWorker:
    def __init__(self):
        self.seqs: dict[str, list[int]] = {}  # what the worker knows of each sequence
        self.queue: list[StepResult] = []
        self.sampled_rows: dict[str, int] = {}
        self.resets = 0  # rows of requests preempted since the worker last saw them

    def submit(self, plan):
        rb = plan.batches[0]
        for new in rb.new_requests:
            self.seqs[new.rid] = list(new.prompt_ids)
        for rid in rb.finished_rids:
            self.seqs.pop(rid)
        rows = []
        for row in rb.rows:
            self.resets += row.reset
            seq = self.seqs[row.rid]
            for j, tok in enumerate(row.input_ids):
                pos = row.start + j
                if tok == PLACEHOLDER:
                    tok = seq[pos]  # the id this worker sampled for that position
                assert tok == seq[pos], f"{row.rid}: input at {pos} is {tok}, not {seq[pos]}"
            out = []
            if row.sample:
                end = row.start + len(row.input_ids)
                tok = token(row.rid, end)
                if len(seq) == end:
                    seq.append(tok)
                assert seq[end] == tok
                out = [tok]
                self.sampled_rows[row.rid] = self.sampled_rows.get(row.rid, 0) + 1
            rows.append(RowResult(row.rid, out))
        self.queue.append(StepResult(plan.step_id, rows))

    def take(self):
        return self.queue.pop(0)


def run(requests, inflight, num_pages=64, max_model_len=64, conservativeness=1.0):
    cfg = SchedulerConfig(
        num_pages, 4, max_model_len, 8, 32, 8, (EOS,), True, inflight, conservativeness
    )
    s = Scheduler(cfg)
    for rid, prompt, sp in requests:
        s.add_request(GenerateRequest(rid, prompt, sp))
    w = SimWorker()
    got: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    reasons = {}
    depths = []

    def submit(plan):
        depths.append(s.num_inflight)  # plans out, this one included
        w.submit(plan)

    for _ in range(2000):
        if not s.has_work():
            break
        for out in s.pump(submit, w.take):
            got[out.rid].extend(out.token_ids)
            if out.finish_reason:
                reasons[out.rid] = out.finish_reason
    assert not s.has_work() and not w.seqs, "the worker must drop every request"
    assert s.num_free_pages == s.num_usable_pages
    s.check_integrity()
    return got, reasons, w, max(depths)


REQUESTS = [
    ("eos5", [1, 2, 3, 4], SamplingParams(max_tokens=20)),
    ("len7", [5, 6, 7], SamplingParams(max_tokens=7, ignore_eos=True)),
    ("eos1", [8, 9, 10], SamplingParams(max_tokens=20)),
    ("long", list(range(1, 19)), SamplingParams(max_tokens=12, ignore_eos=True)),
    ("one", [3, 3], SamplingParams(max_tokens=1)),
]


def test_two_plans_in_flight_give_the_same_outputs():
    sync, sync_reasons, _, depth1 = run(REQUESTS, inflight=1)
    over, over_reasons, w, depth2 = run(REQUESTS, inflight=2)
    assert depth1 == 1 and depth2 == 2
    assert over == sync and over_reasons == sync_reasons
    assert sync_reasons == {
        "eos5": "stop",
        "len7": "length",
        "eos1": "stop",
        "long": "length",
        "one": "length",
    }
    assert len(over["eos5"]) == 6 and over["eos5"][-1] == EOS
    assert len(over["len7"]) == 7 and len(over["long"]) == 12 and len(over["one"]) == 1
    # max_tokens is never overrun, even speculatively: a row per allowed token
    assert w.sampled_rows["len7"] == 7 and w.sampled_rows["one"] == 1


def test_stop_on_eos_drops_the_row_already_in_flight():
    _, _, w, _ = run([REQUESTS[0]], inflight=2)
    # 5 tokens + EOS, plus one decode planned before the EOS came back
    assert w.sampled_rows["eos5"] == 7


@pytest.mark.parametrize("inflight", [1, 2])
def test_context_limit_counts_tokens_in_flight(inflight):
    sp = SamplingParams(max_tokens=50, ignore_eos=True)
    got, reasons, w, _ = run([("r", [1, 2, 3, 4], sp)], inflight, max_model_len=9)
    assert reasons == {"r": "length"} and len(got["r"]) == 5  # 4 + 5 == max_model_len
    assert w.sampled_rows["r"] == 5


@pytest.mark.parametrize("inflight", [1, 2])
def test_preemption_with_tokens_in_flight(inflight):
    # 9 usable pages of 4 tokens: four requests growing to 30 tokens cannot all fit
    reqs = [
        (f"p{i}", list(range(1 + i, 9 + i)), SamplingParams(max_tokens=22, ignore_eos=True))
        for i in range(4)
    ]
    # no admission reserve: all four start, and decodes outgrow the cache
    got, reasons, w, _ = run(reqs, inflight, num_pages=10, conservativeness=0.0)
    ref, _, w_ref, _ = run(reqs, 1, num_pages=64)
    assert w.resets > 0 and w_ref.resets == 0
    assert got == ref and set(reasons.values()) == {"length"}


@pytest.mark.parametrize("inflight", [1, 2])
def test_admission_reserve_avoids_recomputing_preempted_requests(inflight):
    # 8 requests of 6-prompt + 18-output tokens on 15 usable pages of 4 tokens
    reqs = [
        (f"r{i}", [1 + i] * 6, SamplingParams(max_tokens=18, ignore_eos=True)) for i in range(8)
    ]
    greedy, _, w_greedy, _ = run(reqs, inflight, num_pages=16, conservativeness=0.0)
    reserved, reasons, w_reserved, _ = run(reqs, inflight, num_pages=16)
    assert reserved == greedy and set(reasons.values()) == {"length"}
    assert w_greedy.resets > 0  # without the reserve, prompts are computed again
    assert w_reserved.resets < w_greedy.resets


def test_placeholders_only_in_decode_rows():
    cfg = SchedulerConfig(64, 4, 64, 8, 32, 8, (EOS,), True, 2)
    s = Scheduler(cfg)
    s.add_request(GenerateRequest("a", [1, 2, 3], SamplingParams(max_tokens=5)))
    p1 = s.build_plan()
    assert p1.batches[0].rows[0].input_ids == [1, 2, 3] and s.may_plan()
    p2 = s.build_plan()  # planned before p1's result is back
    row = p2.batches[0].rows[0]
    assert row.start == 3 and row.input_ids == [PLACEHOLDER] and row.sample
    assert not s.may_plan()
    with pytest.raises(AssertionError):
        s.build_plan()
