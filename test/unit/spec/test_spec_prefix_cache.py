"""EAGLE3 on a prefix-cache hit: the drafter's KV of the cached pages is reused (the
cache key of a page holds the token after it, on which that KV depends), so a prompt
served again drafts exactly as it did when every page was computed (float32). A wrong
reuse would not change the tokens (verification keeps them lossless) but would cost
acceptance unseen; the drafts show it."""

from __future__ import annotations

import pytest
import torch
from spec_util import engine, make_pair, prompts, run

from gyrfalcon.ipc.messages import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def record_drafts(eng) -> list[list[list[int]]]:
    """Every draft round's drafts (one list of k ids per proposing row), in order."""
    drafter, rounds = eng.worker.drafter, []
    real = drafter.draft

    def recorded(rnd, ids, aux, accept_len, draft_tokens) -> None:
        real(rnd, ids, aux, accept_len, draft_tokens)
        rounds.append(draft_tokens[rnd.slots].tolist())

    drafter.draft = recorded
    return rounds


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("spec-cache-pair"))


@pytest.mark.parametrize("k", [1, 3])
def test_a_cached_prefix_drafts_as_a_computed_one(pair, k):
    eng = engine(*pair, k, page_size=4, num_kv_pages=128)
    drafts = record_drafts(eng)
    ps = prompts(11, [23, 9])
    cold = run(eng, ps, GREEDY)
    computed = list(drafts)
    warm = run(eng, ps, GREEDY)
    assert [o.num_cached_tokens for o in cold.final] == [0, 0]
    assert all(o.num_cached_tokens >= 8 for o in warm.final)  # NOTE: whole pages only
    assert warm.ids == cold.ids
    assert computed and drafts[len(computed) :] == computed


def test_corrupted_drafter_pages_change_the_drafts(pair):
    """The check above can fail: the same second serving after the drafter's cached KV
    is overwritten drafts differently."""
    eng = engine(*pair, 3, page_size=4, num_kv_pages=128)
    drafts = record_drafts(eng)
    ps = prompts(11, [23, 9])
    run(eng, ps, GREEDY)
    computed = list(drafts)
    cache = eng.worker.drafter.kv_cache
    with torch.no_grad():
        for t in (cache.k, cache.v):
            t.normal_(generator=torch.Generator().manual_seed(0))
    run(eng, ps, GREEDY)
    assert drafts[len(computed) :] != computed
