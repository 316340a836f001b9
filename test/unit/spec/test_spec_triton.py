"""The spec path on the triton attention backend (the GPU default for verify and the
draft steps) through static-buffer replay, kernels in the Triton interpreter: the
fused greedy step and the general path's round graph set up every backend they
attend with (the drafter's extend backend inside the target's graph included), a
mixed round's extend runs in the drafter's whole graph, and both stay token-identical
to plain decoding on torch_ref."""

import triton_interpret  # noqa: F401  NOTE: before spec_util, which imports the kernels

# isort: split
import pytest
from spec_util import engine, make_pair, prompts, record_graph_runs, run

from gyrfalcon.ipc.messages import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LENS = [5, 7, 6]
GRAPHS = dict(static_graph_replay=True, cuda_graph_bs="1,2,4", cuda_graph_max_bs=4)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("spec-triton"), hidden=32)


@pytest.mark.parametrize("fused", [True, False])
def test_spec_on_triton_under_static_replay_is_lossless(pair, fused):
    target, draft = pair
    plain = run(engine(target), prompts(3, LENS), GREEDY)
    eng = engine(target, draft, 2, attention_backend="triton", **GRAPHS)
    assert eng.worker.drafter.backends.extend.name == "triton"
    if not fused:
        eng.worker.fused = None
    runs = record_graph_runs(eng)
    got = run(eng, prompts(3, LENS), GREEDY)
    assert got.ids == plain.ids and got.verify_steps > 0
    assert any(r[:2] == ("VERIFY", "step") for r in runs) == fused
    # NOTE: the prompts' round (rows of any length) extends in the drafter's whole graph
    pw = eng.worker.drafter.piecewise
    assert pw is not None and pw.whole and pw.num_whole_runs > 0
