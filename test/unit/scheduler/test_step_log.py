from gyrfalcon.ipc.messages import GenerateRequest, RowResult, SamplingParams, StepResult
from gyrfalcon.scheduler.scheduler import Scheduler, SchedulerConfig
from gyrfalcon.scheduler.step_log import StepCounters, ThroughputLog


def run_steps(s, n):
    for _ in range(n):
        plan = s.build_plan()
        rows = [RowResult(r.rid, [7] if r.sample else []) for r in plan.batches[0].rows]
        s.process_result(StepResult(plan.step_id, rows))


def test_counters_split_prompt_and_generated_tokens():
    # chunk 4: a 10-token prompt takes 3 prefill steps (4, 4, 2), the last one samples
    s = Scheduler(SchedulerConfig(32, 4, 64, 8, 64, 4, (99,), True))
    s.add_request(GenerateRequest("a", list(range(1, 11)), SamplingParams(max_tokens=5)))
    run_steps(s, 3)
    assert (s.counters.steps, s.counters.prompt_tokens, s.counters.generated_tokens) == (3, 10, 1)
    run_steps(s, 4)  # decodes: one token in, one out, none of them prompt tokens
    assert (s.counters.prompt_tokens, s.counters.generated_tokens) == (10, 5)
    assert s.counters.preemptions == 0


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_throughput_line_rates_over_the_interval():
    clock = Clock()
    log = ThroughputLog(10.0, clock)
    c = StepCounters(steps=50, prompt_tokens=4000, generated_tokens=2000, preemptions=1)
    clock.t += 5.0
    assert log.line(c, 3, 2, 10, 100) is None  # interval not over
    clock.t += 5.0
    line = log.line(c, 3, 2, 25, 100)
    assert line == (
        "5.0 steps/s, prompt 400 tok/s, generation 200 tok/s, running 3, waiting 2, "
        "KV 25.0% of 100 pages, preempted 1"
    )
    c2 = StepCounters(steps=70, prompt_tokens=4000, generated_tokens=2400, preemptions=1)
    clock.t += 20.0
    assert log.line(c2, 3, 0, 25, 100).startswith("1.0 steps/s, prompt 0 tok/s, generation 20 ")
    clock.t += 20.0
    assert log.line(c2, 0, 0, 0, 100) is None  # idle: nothing to report


def test_interval_zero_never_logs():
    clock = Clock()
    log = ThroughputLog(0.0, clock)
    clock.t += 1000.0
    assert log.line(StepCounters(steps=5), 1, 0, 1, 10) is None


def test_spec_acceptance_joins_the_line_over_the_interval():
    """A server with speculative decoding logs tokens emitted per verify step (accepted
    drafts + 1) over the interval; verify steps and accepts count as results arrive."""
    clock = Clock()
    log = ThroughputLog(10.0, clock)
    c = StepCounters(steps=10, generated_tokens=30)
    for a in (3, 1, 0, 2):
        c.add_verified(a)
    clock.t += 10.0
    assert log.line(c, 1, 0, 1, 10).endswith("preempted 0, spec accept length 2.50")
    c.steps += 1
    clock.t += 10.0
    assert "spec" not in log.line(c, 1, 0, 1, 10)  # no verify step in this interval
