"""Speculative decoding never changes greedy outputs (CPU, float32): a tiny random
Llama target with a random EAGLE3 drafter (it accepts little) and with a forcing
drafter (every acceptance pattern), k in {1, 2, 3, 5}, batches mixing new prompts,
chunked prefill, decodes, spec rows and finishing rows; zero leaked pages after each
(target and drafter pages are the same pages)."""

from __future__ import annotations

import pytest
from spec_util import (
    check_round_replay,
    engine,
    force_drafts,
    make_pair,
    prompts,
    random_pattern,
    record_accepts,
    record_graph_runs,
    run,
)

from gyrfalcon.ipc.messages import ForwardMode, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
LENS = [5, 17, 9, 30]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("spec-pair"))


@pytest.fixture(scope="module")
def plain(pair):
    target, _ = pair
    return run(engine(target, chunked_prefill_size=8), prompts(1, LENS), GREEDY)


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_random_drafter_is_lossless(pair, plain, k):
    target, draft = pair
    got = run(engine(target, draft, k, chunked_prefill_size=8), prompts(1, LENS), GREEDY)
    assert got.ids == plain.ids
    assert got.verify_steps > 0


def test_separate_prefill_steps_are_lossless(pair, plain):
    """--separate-prefill-steps with EAGLE3: prompts and chunks run in steps of their own
    (no MIXED step; the same prompts mix without the flag), outputs equal plain, no
    page leaked (run checks)."""
    target, draft = pair
    modes = {}
    for apart in (False, True):
        eng = engine(target, draft, 3, chunked_prefill_size=8, separate_prefill_steps=apart)
        seen = modes[apart] = []
        submit = eng.worker.submit
        eng.worker.submit = lambda plan, seen=seen, submit=submit: (
            seen.append(plan.batches[0].forward_mode) or submit(plan)
        )
        got = run(eng, prompts(1, LENS), GREEDY)
        assert got.ids == plain.ids and got.verify_steps > 0
    assert ForwardMode.MIXED in modes[False] and ForwardMode.MIXED not in modes[True]
    assert ForwardMode.VERIFY in modes[True] and ForwardMode.PREFILL in modes[True]


PATTERNS = {
    "all_k": lambda k: lambda rid, p: k,
    "none": lambda k: lambda rid, p: 0,
    "mixed": lambda k: lambda rid, p: k if int(rid) % 2 else 0,
    "random": lambda k: random_pattern(7, k),
}
LENS3 = [5, 7, 6]


@pytest.fixture(scope="module")
def plain3(pair):
    target, _ = pair
    return run(engine(target), prompts(2, LENS3), GREEDY)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_forced_acceptance_patterns_are_lossless(pair, plain3, k, name, fused):
    """Three requests decoding together: their VERIFY steps run in the static-replay
    graph of 4 rows (one padded), as the fused greedy step (spec_step_graph.py) or
    through the general path; each pattern's accepts show in the counters."""
    target, draft = pair
    eng = engine(
        target, draft, k, static_graph_replay=True, cuda_graph_bs="1,2,4", cuda_graph_max_bs=4
    )
    if not fused:
        eng.worker.fused = None
    ps = prompts(2, LENS3)
    seqs = {str(i): p + out for i, (p, out) in enumerate(zip(ps, plain3.ids))}
    made = force_drafts(eng, seqs, PATTERNS[name](k), k)
    sizes = record_graph_runs(eng)
    got = run(eng, ps, GREEDY)
    assert got.ids == plain3.ids
    assert made and got.verify_steps
    assert (("VERIFY", "step", 3) if fused else ("VERIFY", 3)) in sizes  # padded 3 -> 4
    if name == "all_k":  # every step accepts k, except where max_tokens caps the drafts
        assert got.accepted >= k * (got.verify_steps - len(LENS3))
    if name == "none":
        assert got.accepted == 0
    if name == "mixed":
        accepted = [o.num_accepted for o in got.final]
        assert accepted[0] == accepted[2] == 0 and accepted[1] > 0


def test_rows_near_max_tokens_stay_in_the_fused_graph(pair):
    """Requests with different max_tokens finish at different steps: every step of
    decode rows only is one fused replay (rows keep k drafts up to the end; tokens
    past max_tokens are dropped), and outputs equal plain decoding's."""
    target, draft = pair
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (5, 9, 14)]
    ps = prompts(4, LENS3)
    plain = run(engine(target), ps, params)
    kw = dict(static_graph_replay=True, cuda_graph_bs="1,2,4", cuda_graph_max_bs=4)
    eng = engine(target, draft, 3, **kw)
    decisions = []  # per decode-only step: whether it ran fused
    fused = eng.worker.fused
    takes = fused.takes

    def recorded(rows, reqs, agreed, graphs):
        out = takes(rows, reqs, agreed, graphs)
        if all(len(r.input_ids) == 1 for r in rows):
            decisions.append(out)
        return out

    fused.takes = recorded
    got = run(eng, ps, params)
    assert got.ids == plain.ids and [len(x) for x in got.ids] == [5, 9, 14]
    assert len(decisions) > 5 and all(decisions), decisions


@pytest.mark.parametrize("overlap", [True, False])
def test_floating_verify_rows_are_lossless(pair, plain3, overlap):
    """Overlap scheduling sends a request's next verify row while its previous one is in
    flight (a floating row: the worker takes its start from the device). Random forced
    acceptance through static replay: outputs equal plain; floating rows ran, and only
    with overlap."""
    target, draft = pair
    kw = dict(static_graph_replay=True, cuda_graph_bs="1,2,4", cuda_graph_max_bs=4)
    eng = engine(target, draft, 3, disable_overlap_schedule=not overlap, **kw)
    ps = prompts(2, LENS3)
    seqs = {str(i): p + out for i, (p, out) in enumerate(zip(ps, plain3.ids))}
    made = force_drafts(eng, seqs, random_pattern(3, 3), 3)
    floating = []
    submit = eng.worker.submit
    eng.worker.submit = lambda plan: (
        floating.extend(r.rid for r in plan.batches[0].rows if r.drafts_in_flight) or submit(plan)
    )
    got = run(eng, ps, GREEDY)
    assert got.ids == plain3.ids and made and got.accepted > 0
    assert bool(floating) == overlap


@pytest.mark.parametrize("k", [1, 3])
def test_draft_round_graph_replay_equals_eager(pair, plain3, k):
    """Every round of verify rows runs as one padded static replay (3 rows -> 4) and
    proposes exactly the drafts the eager round proposes from the same state."""
    target, draft = pair
    eng = engine(
        target, draft, k, static_graph_replay=True, cuda_graph_bs="1,2,4", cuda_graph_max_bs=4
    )
    eng.worker.fused = None  # NOTE: the general path's round graph
    compared = check_round_replay(eng)
    got = run(eng, prompts(2, LENS3), GREEDY)
    assert got.ids == plain3.ids
    assert 3 in [rows for rows, _ in compared]  # a padded round


@pytest.mark.parametrize("piecewise", [0, 32], ids=["eager-extend", "piecewise-extend"])
@pytest.mark.parametrize("k", [1, 3])
def test_rounds_after_a_mixed_extend_replay_their_steps(pair, plain3, k, piecewise):
    """A round that is not all verify rows of k drafts (here the three prompts' prefill
    step, and later steps with a prompt's chunk beside verify rows): its extend runs
    eagerly or through the drafter's piecewise graphs (padded to a captured token
    count), then draft 1 and the k - 1 draft steps as one padded static replay
    (DRAFT_DECODE, 3 proposing rows -> 4); every such round proposes exactly the
    all-eager round's drafts, and outputs equal plain."""
    target, draft = pair
    eng = engine(
        target, draft, k, static_graph_replay=True, cuda_graph_bs="1,2,4", cuda_graph_max_bs=4,
        piecewise_cuda_graph_max_tokens=piecewise, chunked_prefill_size=8,
    )  # fmt: skip
    pw = eng.worker.drafter.piecewise
    assert (pw is not None) == bool(piecewise)
    runs = record_graph_runs(eng, drafter=True)
    compared = check_round_replay(eng)
    got = run(eng, prompts(2, LENS3), GREEDY)
    assert got.ids == plain3.ids
    assert ("DRAFT_DECODE", 3) in runs and (3, 1.0) in compared
    if pw is not None:  # NOTE: every mixed round's extend (the prompts' chunks of 8)
        assert pw.num_runs >= 2, pw.num_runs


@pytest.mark.parametrize("k", [1, 3])
def test_fused_step_equals_the_general_path(pair, plain3, k):
    """The fused greedy step (one replay: move, fills, verify, acceptance, records, the
    draft round) and the general path, from the same prompts with the real (random)
    drafter: the same outputs and, step by step, the same accept counts, so the same
    drafts (float32, static replay); 3 rows padded to 4, floating rows included."""
    target, draft = pair
    kw = dict(static_graph_replay=True, cuda_graph_bs="1,2,4", cuda_graph_max_bs=4)
    results, accepts = [], []
    for fused in (True, False):
        eng = engine(target, draft, k, **kw)
        if not fused:
            eng.worker.fused = None
        runs, steps = record_graph_runs(eng), record_accepts(eng)
        results.append(run(eng, prompts(2, LENS3), GREEDY))
        accepts.append(steps)
        assert any(r[:2] == ("VERIFY", "step") for r in runs) == fused
    assert results[0].ids == results[1].ids == plain3.ids
    assert accepts[0] == accepts[1] and results[0].accepted == results[1].accepted > 0


def test_a_request_table_outgrowing_its_reserve_turns_the_fused_step_off(pair, plain3, caplog):
    """The fused step captured the request table's tensors by address: once the table
    is reallocated, steps take the general path (with a warning), outputs unchanged."""
    target, draft = pair
    eng = engine(
        target, draft, 3, static_graph_replay=True, cuda_graph_bs="1,2,4", cuda_graph_max_bs=4
    )
    table = eng.worker.requests
    table._grow(2 * table.last_tokens.shape[0])  # NOTE: what more requests than reserved do
    runs = record_graph_runs(eng)
    got = run(eng, prompts(2, LENS3), GREEDY)
    assert got.ids == plain3.ids and got.verify_steps
    assert ("VERIFY", 3) in runs and not any(r[:2] == ("VERIFY", "step") for r in runs)
    assert "outgrew its reserve" in caplog.text


def test_spec_graphs_capture_in_a_pool_of_a_few_pages(pair):
    """VERIFY and draft-round capture (padded rows on the dummy page, lengths >= 1,
    accept 0) needs no page beyond the dummy one: a pool of 4 pages captures and then
    serves (spec-decode bug class 5)."""
    target, draft = pair
    ps, sp = prompts(5, [3]), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    small = dict(num_kv_pages=4, static_graph_replay=True, cuda_graph_max_bs=4)
    eng = engine(target, draft, 3, **small)
    assert eng.worker.drafter.graphs is not None and eng.worker.executor.graphs is not None
    assert run(eng, ps, sp).ids == run(engine(target, num_kv_pages=4), ps, sp).ids


def test_penalties_logprobs_and_preemption_in_a_tiny_pool(pair):
    """A batch mixing a penalized request (it decodes one token per step), logprobs and
    stop ids, in a pool small enough to preempt, with every draft right: the same
    tokens, finish reasons and logprobs as plain decoding, and no page leaked."""
    target, draft = pair
    ps = prompts(6, [9, 14, 6, 11])
    sps = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, min_tokens=4),
    ]
    small = dict(
        num_kv_pages=12, chunked_prefill_size=6, max_num_batched_tokens=12,
        schedule_conservativeness=0.0,
    )  # fmt: skip
    plain = run(engine(target, **small), ps, sps)
    sps[2] = SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[plain.ids[2][5]]
    )
    plain = run(engine(target, **small), ps, sps)
    eng = engine(target, draft, 3, **small)
    seqs = {str(i): p + o for i, (p, o) in enumerate(zip(ps, plain.ids))}
    force_drafts(eng, seqs, PATTERNS["all_k"](3), 3)
    got = run(eng, ps, sps)
    assert got.ids == plain.ids
    assert [o.finish_reason for o in got.final] == [o.finish_reason for o in plain.final]
    assert got.final[0].num_verify_steps == 0  # penalized: never drafted
    assert eng.scheduler.counters.preemptions > 0
    assert got.accepted > 0
    for want, have in zip(plain.logprobs[1], got.logprobs[1]):
        assert have.token_id == want.token_id
        assert have.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.token_id for t in have.top] == [t.token_id for t in want.top]


def test_seeded_sampling_with_spec_is_reproducible(pair):
    """A seeded sampled request gives the same output every time, whatever runs beside
    it (its draws come from its own generator)."""
    target, draft = pair
    ps = prompts(7, [8, 12])
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    alone = run(engine(target, draft, 3), ps[:1], seeded).ids[0]
    together = run(engine(target, draft, 3), ps, [seeded, other]).ids[0]
    assert alone == together and len(alone) == 16


def _pooled_chi2(a: list[int], b: list[int], bins: int = 12) -> tuple[float, int]:
    """Two-sample chi-square statistic over the `bins` most common tokens plus the
    rest pooled, and its degrees of freedom."""
    from collections import Counter

    ca, cb = Counter(a), Counter(b)
    top = [t for t, _ in (ca + cb).most_common(bins)]
    rows = [(ca[t], cb[t]) for t in top]
    rows.append((len(a) - sum(x for x, _ in rows), len(b) - sum(y for _, y in rows)))
    na, nb = len(a), len(b)
    stat = 0.0
    for x, y in rows:
        if x + y:
            stat += (x * nb - y * na) ** 2 / (na * nb * (x + y))
    return stat, len(rows) - 1


def test_sampled_outputs_follow_the_plain_distribution(pair):
    """Temperature sampling through the whole engine: the tokens at output positions 1
    and 2 (emitted by verify steps, drafts accepted or resampled) are distributed as
    without speculation (two-sample chi-square, p = 0.001)."""
    target, draft = pair
    n = 1200
    p = prompts(8, [6])[0]
    sp = SamplingParams(temperature=0.7, max_tokens=3, ignore_eos=True)
    plain = run(engine(target, max_num_seqs=256), [p] * n, sp).ids
    eng = engine(target, draft, 3, max_num_seqs=256)
    spec = run(eng, [p] * n, sp)
    assert spec.verify_steps > 0
    for pos in (1, 2):
        stat, df = _pooled_chi2([o[pos] for o in plain], [o[pos] for o in spec.ids])
        assert stat < {12: 32.909}[df], (pos, stat)


def test_abort_mid_spec_frees_every_page(pair):
    """Requests aborted while their verify rows (and the drafter's round) are in flight
    end, and every target and drafter page comes back; the others are unaffected."""
    target, draft = pair
    ps = prompts(9, [7, 10, 5])
    plain = run(engine(target), ps, GREEDY)
    eng = engine(target, draft, 3)
    for i, p in enumerate(ps):
        eng.add(str(i), p, GREEDY)
    got: dict[str, list[int]] = {str(i): [] for i in range(len(ps))}
    finished: dict[str, str] = {}
    aborted = False
    while eng.has_work():
        for out in eng.step():
            got[out.rid].extend(out.token_ids)
            if out.finish_reason:
                finished[out.rid] = out.finish_reason
        if not aborted and eng.scheduler.requests["1"].num_pending_drafts:
            eng.abort("1")  # its verify row is in flight
            aborted = True
        eng.check_integrity()
    assert aborted and finished["1"] == "abort"
    assert got["0"] == plain.ids[0] and got["2"] == plain.ids[2]
    assert eng.scheduler.num_free_pages == eng.scheduler.num_usable_pages
    assert not len(eng.worker.requests)  # the worker dropped its state too


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(vocab_size=128), "vocab_size 128 is not the target's 256"),
        (dict(target_hidden_size=32), "target hidden states of width 32"),
        ("d2t_collision", "both to target id"),
        ("no_d2t", "has no d2t"),
    ],
)
def test_a_drafter_that_does_not_fit_fails_at_start_up(pair, tmp_path, overrides, message):
    """The engine refuses such a drafter while it starts, saying what is wrong."""
    from conftest import make_tiny_eagle3
    from safetensors.torch import save_file

    target, _ = pair
    bad = str(tmp_path / "bad")
    tensors = make_tiny_eagle3(bad, **(overrides if isinstance(overrides, dict) else {}))
    if overrides == "d2t_collision":  # draft ids 0 and 1 -> one target id
        tensors["d2t"][1] = tensors["d2t"][0] - 1
        tensors.pop("t2d")
    if overrides == "no_d2t":
        tensors.pop("d2t")
        tensors.pop("t2d")
    if isinstance(overrides, str):
        save_file(tensors, f"{bad}/model.safetensors")
    with pytest.raises(ValueError, match=message):
        engine(target, bad, 3)
