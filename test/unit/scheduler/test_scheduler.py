from gyrfalcon.ipc.messages import (
    ForwardMode,
    GenerateRequest,
    RowResult,
    SamplingParams,
    StepResult,
)
from gyrfalcon.scheduler.scheduler import Scheduler, SchedulerConfig

EOS = 99


def make(num_pages=32, max_model_len=64, chunk=8):
    return Scheduler(SchedulerConfig(num_pages, 4, max_model_len, 8, 64, chunk, (EOS,), True))


def fake_step(s, tokens):
    """Run one step, answering every sampling row with tokens[rid] (a list consumed in order)."""
    plan = s.build_plan()
    if plan is None:
        return None, []
    rows = []
    for row in plan.batches[0].rows:
        emitted = [tokens[row.rid].pop(0)] if row.sample else []
        rows.append(RowResult(row.rid, emitted))
    return plan, s.process_result(StepResult(plan.step_id, rows))


def test_request_lifecycle_stop_on_eos_frees_pages():
    s = make()
    s.add_request(GenerateRequest("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=10)))
    plan, out = fake_step(s, {"r": [10, 11, EOS]})
    assert plan.batches[0].forward_mode == ForwardMode.PREFILL
    assert plan.batches[0].new_requests[0].rid == "r" and out[0].token_ids == [10]
    plan, out = fake_step(s, {"r": [11, EOS]})
    assert plan.batches[0].forward_mode == ForwardMode.DECODE and plan.batches[0].new_requests == []
    assert plan.batches[0].rows[0].start == 5 and plan.batches[0].rows[0].input_ids == [10]
    plan, out = fake_step(s, {"r": [EOS]})
    assert out[0].finish_reason == "stop" and out[0].token_ids == [EOS]
    assert out[0].num_output_tokens == 3
    assert s.num_free_pages == s.num_usable_pages
    plan, _ = fake_step(s, {})
    assert plan.batches[0].finished_rids == ["r"]  # the worker is told to drop it
    s.check_integrity()


def test_max_tokens_and_ignore_eos():
    s = make()
    s.add_request(GenerateRequest("r", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True)))
    _, out1 = fake_step(s, {"r": [EOS]})
    _, out2 = fake_step(s, {"r": [EOS]})
    assert out1[0].finish_reason is None and out2[0].finish_reason == "length"


def test_stop_token_ids():
    s = make()
    s.add_request(GenerateRequest("r", [1, 2], SamplingParams(max_tokens=9, stop_token_ids=[42])))
    _, out = fake_step(s, {"r": [42]})
    assert out[0].finish_reason == "stop"


def test_prompt_too_long_is_an_error_not_a_crash():
    s = make(max_model_len=8)
    s.add_request(GenerateRequest("r", list(range(8)), SamplingParams()))
    out = s.take_outputs()
    assert out[0].finish_reason == "error" and "context length" in out[0].error
    assert not s.has_work()


def test_abort_waiting_and_running():
    s = make()
    s.add_request(GenerateRequest("a", [1, 2, 3], SamplingParams(max_tokens=5)))
    fake_step(s, {"a": [5]})
    s.add_request(GenerateRequest("b", [1, 2, 3], SamplingParams(max_tokens=5)))
    s.abort("a")
    s.abort("b")
    out = s.take_outputs()
    assert [(o.rid, o.finish_reason) for o in out] == [("a", "abort"), ("b", "abort")]
    assert s.num_free_pages == s.num_usable_pages
    assert s.has_work()  # the worker still holds "a"
    plan, _ = fake_step(s, {})
    assert plan.batches[0].finished_rids == ["a"] and not s.has_work()
    s.check_integrity()
    s.abort("unknown")  # ignored


def test_context_limit_finishes_with_length():
    s = make(max_model_len=6)
    s.add_request(GenerateRequest("r", [1, 2, 3, 4], SamplingParams(max_tokens=50)))
    reasons = []
    for _ in range(3):
        _, out = fake_step(s, {"r": [7]})
        reasons += [o.finish_reason for o in out]
    assert reasons[:2] == [None, "length"]


def test_arrivals_beyond_max_queue_len_are_refused_with_503_until_the_queue_drains():
    import dataclasses

    s = make()
    s.cfg = dataclasses.replace(s.cfg, max_queue_len=2)
    for rid in ("a", "b", "c"):
        s.add_request(GenerateRequest(rid, [1, 2, 3], SamplingParams(max_tokens=2)))
    (refused,) = s.take_outputs()
    assert refused.rid == "c" and refused.finish_reason == "error"
    assert refused.error_status == 503 and "--max-queue-len" in refused.error
    assert set(s.requests) == {"a", "b"}
    fake_step(s, {"a": [10], "b": [10]})  # both admitted: none waits now
    s.add_request(GenerateRequest("c", [1, 2, 3], SamplingParams(max_tokens=2)))
    assert s.take_outputs() == [] and "c" in s.requests
    s.check_integrity()


def test_max_queue_len_flag_reaches_the_scheduler():
    from gyrfalcon.config.server_args import ServerArgs

    for flag, limit in ((None, 0), (5, 5)):
        args = ServerArgs(device="cpu", max_queue_len=flag).resolved()
        assert SchedulerConfig.from_args(args, 32, 64, (EOS,)).max_queue_len == limit
