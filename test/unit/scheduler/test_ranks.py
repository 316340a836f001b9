"""Per-DP-rank plans: each rank has its own pages, queues and batch; an idle rank gets
an IDLE batch; each rank's results are applied on their own, in any interleaving."""

import pytest

from gyrfalcon.ipc.contract import PLACEHOLDER, RankLayout, piecewise_sizes
from gyrfalcon.ipc.messages import (
    ForwardMode,
    GenerateRequest,
    RankBatch,
    RequestOutput,
    RowResult,
    SamplingParams,
    ScheduledRow,
    StepResult,
)
from gyrfalcon.scheduler.outputs import interleave
from gyrfalcon.scheduler.plan import agreed_graph, agreed_tokens
from gyrfalcon.scheduler.scheduler import Scheduler, SchedulerConfig

EOS = 99


def token(rid: str, pos: int) -> int:
    return 10 + (sum(map(ord, rid)) * 31 + pos * 17) % 80


class RankSim:
    """One DP rank's worker: runs its batch of every plan, in order."""

    def __init__(self, dp_rank: int):
        self.dp_rank = dp_rank
        self.seqs: dict[str, list[int]] = {}
        self.results: list[StepResult] = []
        self.modes: list[ForwardMode] = []
        self.graph_rows: list[int] = []
        self.graph_tokens: list[int] = []

    def submit(self, plan):
        rb = plan.batches[self.dp_rank]
        self.modes.append(rb.forward_mode)
        self.graph_rows.append(plan.graph_rows)
        self.graph_tokens.append(plan.graph_tokens)
        for rid in rb.finished_rids:
            del self.seqs[rid]
        for new in rb.new_requests:
            self.seqs[new.rid] = list(new.prompt_ids)
        assert (rb.forward_mode == ForwardMode.IDLE) == (not rb.rows)
        rows = []
        for row in rb.rows:
            seq = self.seqs[row.rid]  # KeyError: a row on a rank that never got the request
            for j, tok in enumerate(row.input_ids):
                assert tok in (PLACEHOLDER, seq[row.start + j])
            emitted = []
            if row.sample:
                end = row.start + len(row.input_ids)
                if len(seq) == end:
                    seq.append(token(row.rid, end))
                emitted = [seq[end]]
            rows.append(RowResult(row.rid, emitted))
        self.results.append(StepResult(plan.step_id, rows, self.dp_rank))


def run(requests, dp_size, inflight, order, piecewise=()):
    """order(ranks) -> the rank whose oldest result is delivered next; piecewise: the
    token counts of the workers' piecewise graphs."""
    cfg = SchedulerConfig(
        64, 4, 64, 8, 32, 8, (EOS,), True, inflight, 1.0, dp_size, piecewise_sizes=piecewise
    )
    s = Scheduler(cfg)
    for rid, prompt, sp in requests:
        s.add_request(GenerateRequest(rid, prompt, sp))
    sims = [RankSim(r) for r in range(dp_size)]
    got: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    turn = [0]

    def submit(plan):
        assert len(plan.batches) == dp_size
        for sim in sims:
            sim.submit(plan)

    def receive():
        ready = [sim for sim in sims if sim.results]
        turn[0] += 1
        return order(ready, turn[0]).results.pop(0)

    while s.has_work():
        for out in s.pump(submit, receive):
            got[out.rid].extend(out.token_ids)
    assert not any(sim.seqs for sim in sims) and not any(sim.results for sim in sims)
    assert s.num_free_pages == s.num_usable_pages == dp_size * 63
    s.check_integrity()
    return got, sims


def first(ready, turn):
    return ready[0]


def last(ready, turn):
    return ready[-1]


def alternate(ready, turn):
    return ready[turn % len(ready)]


REQUESTS = [
    ("a", [1, 2, 3], SamplingParams(max_tokens=9, ignore_eos=True)),
    ("b", [4, 5], SamplingParams(max_tokens=2, ignore_eos=True)),
    ("c", list(range(1, 12)), SamplingParams(max_tokens=5, ignore_eos=True)),
]


@pytest.mark.parametrize("order", [first, last, alternate])
@pytest.mark.parametrize("inflight", [1, 2])
def test_two_ranks_give_the_outputs_of_one(inflight, order):
    ref, _ = run(REQUESTS, 1, inflight, first)
    got, sims = run(REQUESTS, 2, inflight, order)
    assert got == ref
    # requests join the rank with fewer: a -> 0, b -> 1, c -> 0; b ends first, so rank 1
    # idles (a dummy row) while rank 0 still decodes
    assert ForwardMode.IDLE in sims[1].modes and ForwardMode.IDLE not in sims[0].modes[:3]


def test_requests_are_bound_to_a_rank_with_its_own_pages():
    cfg = SchedulerConfig(8, 4, 64, 8, 32, 16, (EOS,), True, 1, 1.0, 2)
    s = Scheduler(cfg)
    for rid in "abc":
        s.add_request(GenerateRequest(rid, [1, 2, 3, 4, 5], SamplingParams(max_tokens=4)))
    assert [s.requests[r].dp_rank for r in "abc"] == [0, 1, 0]
    plan = s.build_plan()
    assert [[r.rid for r in b.rows] for b in plan.batches] == [["a", "c"], ["b"]]
    assert [[n.rid for n in b.new_requests] for b in plan.batches] == [["a", "c"], ["b"]]
    assert s.ranks[0].alloc.num_free == 7 - 4 and s.ranks[1].alloc.num_free == 7 - 2
    s.abort("b")
    s.check_integrity()
    # rank 1's result still comes (and is dropped); its next batch only drops b
    s.process_result(StepResult(plan.step_id, [RowResult("b", [7])], 1))
    assert s.num_inflight == 1  # rank 0's result is not in yet
    s.process_result(StepResult(plan.step_id, [RowResult("a", [7]), RowResult("c", [8])], 0))
    plan = s.build_plan()
    idle = plan.batches[1]
    assert idle.forward_mode == ForwardMode.IDLE and idle.rows == []
    assert idle.finished_rids == ["b"] and plan.batches[0].finished_rids == []


def serve(s: Scheduler, outputs: dict[str, list[int]]) -> dict[str, int]:
    """Every rank's rows answered from outputs[rid] until idle; the start of each
    request's first row (its cached prefix)."""
    starts: dict[str, int] = {}
    while s.has_work():
        plan = s.build_plan()
        for dp_rank, batch in enumerate(plan.batches):
            for r in batch.rows:
                starts.setdefault(r.rid, r.start)
            rows = [
                RowResult(r.rid, [outputs[r.rid].pop(0)] if r.sample else []) for r in batch.rows
            ]
            s.process_result(StepResult(plan.step_id, rows, dp_rank))
    s.check_integrity()
    return starts


def test_a_chats_next_turn_goes_to_the_rank_holding_its_earlier_turns():
    """DP attention with prefix caching: each DP rank caches only its own pages, so a
    second turn routed by load alone would compute the whole conversation again."""
    cfg = SchedulerConfig(32, 4, 64, 8, 64, 64, (EOS,), True, 1, 1.0, 2, prefix_caching=True)
    s = Scheduler(cfg)
    first = {"x": list(range(1, 11)), "y": list(range(30, 40))}
    for rid, prompt in first.items():
        s.add_request(GenerateRequest(rid, prompt, SamplingParams(max_tokens=3)))
    assert [s.requests[r].dp_rank for r in "xy"] == [0, 1]
    serve(s, {"x": [20, 21, EOS], "y": [50, 51, EOS]})
    # y's next turn: rank 0 is the least loaded rank and the lowest, but y's pages are
    # on rank 1; x's next turn then goes to rank 0 although rank 1 is as busy
    y2 = first["y"] + [50, 51, EOS, 60, 61]
    x2 = first["x"] + [20, 21, EOS, 70, 71]
    s.add_request(GenerateRequest("y2", y2, SamplingParams(max_tokens=1)))
    s.add_request(GenerateRequest("x2", x2, SamplingParams(max_tokens=1)))
    assert [s.requests[r].dp_rank for r in ("y2", "x2")] == [1, 0]
    starts = serve(s, {"y2": [EOS], "x2": [EOS]})
    assert starts == {"y2": 12, "x2": 12}  # 10 prompt + 2 outputs computed, found cached
    # x's pages are on rank 0: more of its turns go there while rank 0 holds at most 2
    # requests more than rank 1 (the slack), then load wins over the cache
    more = [f"x{i}" for i in range(3, 7)]
    for rid in more:
        s.add_request(GenerateRequest(rid, x2 + [EOS, 80], SamplingParams(max_tokens=1)))
    assert [s.requests[r].dp_rank for r in more] == [0, 0, 0, 1]
    starts = serve(s, {rid: [EOS] for rid in more})
    assert [starts[r] for r in more] == [12, 12, 12, 0]  # x2 cached 3 pages


def test_rank_layout_maps_ranks_to_dp_groups():
    layout = RankLayout(dp_size=2, tp_size=2)
    assert layout.world_size == 4
    assert [layout.dp_rank(r) for r in range(4)] == [0, 0, 1, 1]
    assert [layout.reports(r) for r in range(4)] == [True, False, True, False]
    assert RankLayout().world_size == 1 and RankLayout().reports(0)


def _batch(mode: ForwardMode, rows: int, drafts: int = 0, inputs: int = 1) -> RankBatch:
    rows_ = [ScheduledRow(f"r{i}", 4, [1] * inputs, [], True, False, drafts) for i in range(rows)]
    return RankBatch(mode, rows_)


V, D, IDLE = ForwardMode.VERIFY, ForwardMode.DECODE, ForwardMode.IDLE


@pytest.mark.parametrize(
    "batches, want",
    [
        ([_batch(D, 3), _batch(D, 5)], (5, 1)),
        ([_batch(D, 3), _batch(IDLE, 0)], (3, 1)),
        ([_batch(IDLE, 0), _batch(IDLE, 0)], (1, 1)),  # the dummy rows
        ([_batch(D, 3), _batch(ForwardMode.MIXED, 2)], (0, 1)),
        ([_batch(ForwardMode.PREFILL, 1), _batch(IDLE, 0)], (0, 1)),
        # uniform verify rows (one input, all k = 3 drafts): the VERIFY graphs' width,
        # which an idle rank's dummy row takes too
        ([_batch(V, 2, 3), _batch(V, 5, 3)], (5, 4)),
        ([_batch(V, 2, 3), _batch(IDLE, 0)], (2, 4)),
        ([_batch(V, 2, 3), _batch(D, 2)], (0, 1)),  # one graph width a step
        ([_batch(V, 2, 2), _batch(IDLE, 0)], (0, 1)),  # fewer drafts (the context's end)
        ([_batch(V, 2, 3, inputs=2), _batch(IDLE, 0)], (0, 1)),  # a row of two inputs
    ],
)
def test_dp_ranks_agree_on_one_graph_or_all_run_eagerly(batches, want):
    """With experts over DP attention every rank replays one graph (mode width and the
    largest rank's rows), or, if any rank's batch runs eagerly, all do (their
    collectives must match)."""
    assert agreed_graph(batches, num_draft=3) == want


def test_without_a_drafter_verify_batches_never_replay_agreed_graphs():
    assert agreed_graph([_batch(V, 2, 3), _batch(IDLE, 0)]) == (0, 1)


def test_the_scheduler_sends_the_agreed_size_with_every_plan():
    _, (sim0, sim1) = run(REQUESTS, 2, 1, first)
    steps = list(zip(sim0.modes, sim1.modes, sim0.graph_rows))
    assert steps[0] == (ForwardMode.PREFILL, ForwardMode.PREFILL, 0)
    # a and c decode on rank 0 while rank 1 idles: both replay the 2-row graph
    assert (ForwardMode.DECODE, ForwardMode.IDLE, 2) in steps
    assert all(rows == 0 for m0, m1, rows in steps if ForwardMode.MIXED in (m0, m1))


@pytest.mark.parametrize(
    "batches, want",
    [
        # the most tokens of any rank, padded to a captured count
        ([_batch(ForwardMode.PREFILL, 1, inputs=20), _batch(D, 3)], 32),
        ([_batch(ForwardMode.PREFILL, 1, inputs=16), _batch(IDLE, 0)], 16),
        ([_batch(ForwardMode.MIXED, 2, inputs=40), _batch(ForwardMode.PREFILL, 1, inputs=3)], 96),
        # a ragged verify step: each row's inputs and its draft slots
        ([_batch(V, 3, 2, inputs=1), _batch(V, 2, 3, inputs=10)], 32),
        ([_batch(IDLE, 0), _batch(IDLE, 0)], 16),  # the dummy rows' one token
        ([_batch(ForwardMode.PREFILL, 1, inputs=513), _batch(D, 3)], 0),  # above 512: eager
    ],
)
def test_dp_ranks_without_one_graph_agree_on_a_padded_token_count(batches, want):
    """Where no agreed graph serves a step, every rank runs its forward as piecewise
    graphs padded to one captured token count that holds every rank's batch (their
    MoE gathers then need no count exchange), or, above the largest, eagerly."""
    assert agreed_tokens(batches, piecewise_sizes(512)) == want
    assert agreed_tokens(batches, []) == 0  # no piecewise graphs: eager


def test_plans_carry_the_agreed_token_count_where_no_graph_is_agreed():
    """The requests' prompts (3, 2 and 11 tokens, in chunks of up to 8 a rank) arrive
    together: the plans of their steps carry the count the most tokens of a rank pad
    to (16 of 4, 16), those of graphs of agreed rows none, and with pieces of at most
    4 tokens they carry 0 (every rank eager)."""
    _, (sim0, sim1) = run(REQUESTS, 2, 1, first, piecewise=(4, 16))
    assert sim1.graph_tokens == sim0.graph_tokens  # one plan for both
    steps = list(zip(sim0.modes, sim1.modes, sim0.graph_rows, sim0.graph_tokens))
    assert steps[0] == (ForwardMode.PREFILL, ForwardMode.PREFILL, 0, 16)
    for m0, m1, rows, tokens in steps:
        assert (tokens == 0) == (rows > 0), (m0, m1, rows, tokens)
    _, (sim0, _) = run(REQUESTS, 2, 1, first, piecewise=(4,))
    assert sim0.graph_tokens[0] == 0 and sim0.graph_rows[0] == 0


@pytest.mark.parametrize("inflight", [1, 2])
def test_chats_in_lock_step_keep_their_rank_turn_after_turn(inflight):
    """Chats that start together with equal answer lengths end every turn in one step
    on both ranks, and their clients send the next turns in the order the outputs
    arrive. Every next turn must go to the rank holding its earlier turns and find
    them cached; with rank 0's finishes all first, the next turns past the routing
    slack went to the other rank (a GPU run of bench_multiturn: 37 of 64 second turns
    kept their rank)."""
    convs, turns, answer = 16, 3, 4
    cfg = SchedulerConfig(
        256, 4, 256, 64, 512, 512, (EOS,), True, inflight, 1.0, 2, prefix_caching=True
    )
    s = Scheduler(cfg)
    system = list(range(1, 9))
    prompts = {f"c{c}t1": system + [20 + c, 40 + c] for c in range(convs)}
    rank_of, kept, cached = {}, [], []
    for rid, prompt in prompts.items():
        s.add_request(GenerateRequest(rid, prompt, SamplingParams(max_tokens=answer)))
        rank_of[rid[: rid.index("t")]] = s.requests[rid].dp_rank
    sims = [RankSim(r) for r in range(2)]
    got: dict[str, list[int]] = {rid: [] for rid in prompts}

    def submit(plan):
        for sim in sims:
            sim.submit(plan)
        for batch in plan.batches:
            for n in batch.new_requests:
                cached.append((n.rid, batch.rows[[r.rid for r in batch.rows].index(n.rid)].start))

    def receive():
        return next(sim for sim in sims if sim.results).results.pop(0)

    while s.has_work():
        for out in s.pump(submit, receive):
            got[out.rid].extend(out.token_ids)
            if out.finish_reason is None:
                continue
            conv, turn = out.rid.split("t")
            if int(turn) < turns:  # the client sends the next turn at once
                rid = f"{conv}t{int(turn) + 1}"
                prompts[rid] = prompts[out.rid] + got[out.rid] + [60, 61]
                got[rid] = []
                s.add_request(GenerateRequest(rid, prompts[rid], SamplingParams(max_tokens=answer)))
                kept.append(s.requests[rid].dp_rank == rank_of[conv])
    assert sorted(rank_of.values()) == [0] * 8 + [1] * 8
    assert len(kept) == convs * (turns - 1) and all(kept)
    # each next turn starts after every page of its earlier turns (the prompt and all
    # but the last answer token computed), never at the shared system prompt alone
    for rid, start in cached:
        if not rid.endswith("t1"):
            earlier = len(prompts[rid]) - 2 - 1
            assert start == earlier // 4 * 4, (rid, start)
    s.check_integrity()


def test_interleave_takes_one_output_of_each_rank_in_turn():
    a0, a1, a2, b0 = (RequestOutput(rid, []) for rid in ("a0", "a1", "a2", "b0"))
    assert interleave([[a0, a1, a2], [b0]]) == [a0, b0, a1, a2]
    assert interleave([[], [b0]]) == [b0] and interleave([]) == []
