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
    run,
)

from gyrfalcon.ipc.messages import SamplingParams

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


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_forced_acceptance_patterns_are_lossless(pair, plain3, k, name):
    """Three requests decoding together: their VERIFY steps run in the static-replay
    graph of 4 rows (one padded); each pattern's accepts show in the counters."""
    target, draft = pair
    eng = engine(
        target, draft, k, static_graph_replay=True, cuda_graph_bs="1,2,4", cuda_graph_max_bs=4
    )
    ps = prompts(2, LENS3)
    seqs = {str(i): p + out for i, (p, out) in enumerate(zip(ps, plain3.ids))}
    made = force_drafts(eng, seqs, PATTERNS[name](k), k)
    graphs, sizes = eng.worker.executor.graphs, []
    replay = graphs.run
    graphs.run = lambda mode, bt: (
        sizes.append((mode.name, len(bt.seq_lens_cpu))) or replay(mode, bt)
    )
    got = run(eng, ps, GREEDY)
    assert got.ids == plain3.ids
    assert made and got.verify_steps
    assert ("VERIFY", 3) in sizes  # a step padded 3 -> 4
    if name == "all_k":  # every step accepts k, except where max_tokens caps the drafts
        assert got.accepted >= k * (got.verify_steps - len(LENS3))
    if name == "none":
        assert got.accepted == 0
    if name == "mixed":
        accepted = [o.num_accepted for o in got.final]
        assert accepted[0] == accepted[2] == 0 and accepted[1] > 0


@pytest.mark.parametrize("k", [1, 3])
def test_draft_round_graph_replay_equals_eager(pair, plain3, k):
    """Every round of verify rows runs as one padded static replay (3 rows -> 4) and
    proposes exactly the drafts the eager round proposes from the same state."""
    target, draft = pair
    eng = engine(
        target, draft, k, static_graph_replay=True, cuda_graph_bs="1,2,4", cuda_graph_max_bs=4
    )
    compared = check_round_replay(eng)
    got = run(eng, prompts(2, LENS3), GREEDY)
    assert got.ids == plain3.ids
    assert 3 in [rows for rows, _ in compared]  # a padded round


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
