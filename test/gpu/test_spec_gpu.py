"""Speculative decoding on CUDA with real graphs (VERIFY, the one-replay draft round,
the draft steps after an eager extend): greedy output == plain output, for a random
drafter and for forced acceptance patterns, zero leaked pages; the draft round's
replays == their eager runs.

Run on the GPU machine: `python -m pytest -q -m gpu test/gpu/test_spec_gpu.py`.
"""

import pytest
import torch
from spec_util import (
    check_round_replay,
    engine,
    force_drafts,
    make_pair,
    prompts,
    random_pattern,
    record_accepts,
    record_drafts,
    record_graph_runs,
    run,
)

from gyrfalcon.ipc.messages import ForwardMode, SamplingParams
from gyrfalcon.worker.spec_step_graph import VARIANT

pytestmark = pytest.mark.gpu

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
WITH_TOP2 = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)
# bfloat16: a verify row (extend kernel) and a decode row may round one logit apart;
# outputs may part only where plain decoding's top two tokens are this close
BF16_TIE = 0.1
LENS = [5, 17, 9, 30, 12, 3]
# triton in float32 (exact); flashinfer reads 16-bit KV only: bfloat16
BACKENDS = {"triton": ("triton", "float32"), "flashinfer": ("flashinfer", "bfloat16")}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("spec-gpu"), hidden=256)


def cuda_engine(target, draft, backend, k=3, **kw):
    name, dtype = BACKENDS[backend]
    return engine(
        target, draft, k, device="cuda", dtype=dtype, attention_backend=name,
        decode_attention_backend=name, page_size=16, num_kv_pages=256, cuda_graph_max_bs=8,
        **kw,
    )  # fmt: skip


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("pattern", ["random_drafter", "all_k", "random"])
def test_spec_is_lossless_under_graphs(pair, backend, k, pattern):
    target, draft = pair
    ps = prompts(3, LENS)
    plain = run(cuda_engine(target, None, backend), ps, WITH_TOP2)
    eng = cuda_engine(target, draft, backend, k)
    if pattern != "random_drafter":
        seqs = {str(i): p + o for i, (p, o) in enumerate(zip(ps, plain.ids))}
        chooser = (lambda rid, p: k) if pattern == "all_k" else random_pattern(5, k)
        force_drafts(eng, seqs, chooser, k)
    got = run(eng, ps, GREEDY)
    if BACKENDS[backend][1] == "float32":
        assert got.ids == plain.ids
    else:
        for want, have, lps in zip(plain.ids, got.ids, plain.logprobs):
            i = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), None)
            if i is not None:
                top = lps[i].top
                assert top[0].logprob - top[1].logprob < BF16_TIE, (i, want, have)
    fused = (ForwardMode.VERIFY, VARIANT) in eng.worker.executor.graphs.specs
    assert eng.worker.executor.graphs.num_runs
    assert fused or eng.worker.drafter.graphs.num_runs  # NOTE: fused: rounds in the step
    if pattern == "all_k" and BACKENDS[backend][1] == "float32":  # bf16: drafts of plain's
        assert got.accepted >= k * (got.verify_steps - len(LENS))  # text go off at a tie


def test_a_cached_prefix_drafts_as_a_computed_one_under_graphs(pair):
    """Triton in float32 under CUDA graphs: prompts served again, their whole pages from
    the prefix cache, draft exactly as when every page was computed (the drafter's cached
    KV reused; test/unit/spec/test_spec_prefix_cache.py on the CPU)."""
    target, draft = pair
    eng = cuda_engine(target, draft, "triton", 3)
    eng.worker.fused = None  # NOTE: every round through Drafter.draft (recorded)
    drafts = record_drafts(eng)
    ps = prompts(3, LENS)
    cold = run(eng, ps, GREEDY)
    computed = list(drafts)
    warm = run(eng, ps, GREEDY)
    assert sum(o.num_cached_tokens for o in warm.final) == 32  # 17 and 30: a page each
    assert warm.ids == cold.ids and computed and drafts[len(computed) :] == computed


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_draft_round_replay_equals_eager(pair, backend):
    target, draft = pair
    eng = cuda_engine(target, draft, backend, 3)
    eng.worker.fused = None  # NOTE: the general path's round graph (fused: in the step)
    runs = record_graph_runs(eng, drafter=True)
    compared = check_round_replay(eng, exact=False)
    run(eng, prompts(4, [6, 7, 5]), GREEDY)
    assert compared and min(same for _, same in compared) == 1.0, compared
    # both graphs: rounds of verify rows, and the steps after the prompts' eager extend
    assert ("DRAFT_EXTEND", 3) in runs and ("DRAFT_DECODE", 3) in runs, runs
    torch.cuda.synchronize()


def test_fused_step_equals_the_general_path_under_graphs(pair):
    """triton, float32, real graphs: the fused greedy step (one replay per step) and the
    general path give the same outputs, equal to plain decoding, and the same accept
    counts step by step, with floating rows. (The random drafter may accept nothing
    here; the CPU twin of this test, static replay, checks accepted runs too.)"""
    target, draft = pair
    ps = prompts(6, LENS)
    results, accepts = [], []
    for fused in (True, False):
        eng = cuda_engine(target, draft, "triton", 3)
        assert eng.worker.fused is not None and eng.scheduler.limits.float_rows
        if not fused:
            eng.worker.fused = None
        steps = record_accepts(eng)
        results.append(run(eng, ps, GREEDY))
        accepts.append(steps)
    plain = run(cuda_engine(target, None, "triton"), ps, GREEDY)
    assert results[0].ids == results[1].ids == plain.ids
    assert accepts[0] == accepts[1] and results[0].verify_steps


# NOTE: its own process: Triton keeps its builds per process, so a kernel an earlier
# test built would not show here
_NO_BUILDS = """
import sys
sys.path.insert(0, sys.argv[3])
from spec_util import engine, prompts, run
from gyrfalcon.ipc.messages import SamplingParams
eng = engine(sys.argv[1], sys.argv[2], 3, device="cuda", dtype="bfloat16",
             attention_backend="triton", decode_attention_backend="triton", page_size=16,
             num_kv_pages=256, cuda_graph_max_bs=8, max_num_seqs=32)
sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
for seed, lens in enumerate([[7], [5, 40, 9], [3] * 12, list(range(2, 50, 2))]):
    run(eng, prompts(seed, lens), sp)
print(eng.worker.compiles.summary())
"""


def test_serving_builds_no_triton_kernel_after_the_warm_up(pair):
    """A spec engine on triton (bf16, graphs up to 8 rows) serves batches of 1 to 24
    prompts, so eager prompt steps, VERIFY and DRAFT_EXTEND rows of many lengths and
    row counts beyond the graphs, and builds no Triton kernel after its warm-up: each
    such build stalls a served step ~0.8 s. Eager rows on the batch's own int64 tables
    built the decode kernel 4 times while serving (stop 39)."""
    import subprocess
    import sys
    from pathlib import Path

    target, draft = pair
    here = str(Path(__file__).resolve().parents[1])
    out = subprocess.run(
        [sys.executable, "-c", _NO_BUILDS, target, draft, here],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "no Triton kernel built while serving", (
        out.stdout[-2000:] + out.stderr[-3000:]
    )
