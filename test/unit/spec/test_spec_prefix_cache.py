"""EAGLE3 on a prefix-cache hit: the drafter's KV of the cached pages is reused (the
cache key of a page holds the token after it, on which that KV depends), so a prompt
served again drafts exactly as it did when every page was computed (float32). A wrong
reuse would not change the tokens (verification keeps them lossless) but would cost
acceptance unseen; the drafts show it. On torch_ref, and on the triton backend (the GPU's)
through static-buffer replay with its kernels in the interpreter."""

import triton_interpret  # noqa: F401  NOTE: before spec_util, which imports the kernels

# isort: split
import pytest
import torch
from spec_util import engine, make_pair, prompts, record_drafts, run

from gyrfalcon.ipc.messages import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
TRITON = dict(
    attention_backend="triton", static_graph_replay=True, cuda_graph_bs="1,2", cuda_graph_max_bs=2
)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("spec-cache-pair"), hidden=32)


@pytest.mark.parametrize(
    "k,backend", [(1, {}), (3, {}), (3, TRITON)], ids=["k1", "k3", "k3-triton-graphs"]
)
def test_a_cached_prefix_drafts_as_a_computed_one(pair, k, backend):
    eng = engine(*pair, k, page_size=4, num_kv_pages=128, **backend)
    eng.worker.fused = None  # NOTE: every round through Drafter.draft (recorded), graphs too
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
