"""Whole piecewise graphs (worker/piecewise_graph.py) on the triton backend through
static replay, kernels in the Triton interpreter: prefill chunks and mixed steps run as
one pass over the static row buffers (decode rows on the decode kernel, the rest on
the extend kernel's flat grid), greedy outputs stay the torch_ref engine's token for
token (also for a step of fewer rows than the step before it), whether or not the
eager steps' metadata would let the decode rows join the extend launch."""

import triton_interpret  # noqa: F401  NOTE: before any gyrfalcon import of the kernels

# isort: split
import pytest
import torch

from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.engine import LocalEngine
from gyrfalcon.ipc.messages import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def engine(model_dir: str, backend: str) -> LocalEngine:
    args = ServerArgs(
        model=model_dir, device="cpu", dtype="float32", page_size=4, num_kv_pages=96,
        static_graph_replay=True, cuda_graph_bs="1,2,4", cuda_graph_max_bs=4,
        chunked_prefill_size=12, piecewise_cuda_graph_max_tokens=32, max_num_seqs=6,
        attention_backend=backend,
    )  # fmt: skip
    return LocalEngine(args, model_dir)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (3, 17, 9, 26)]


@pytest.mark.parametrize("one_launch", [True, False], ids=["one-launch", "decode-launch"])
def test_whole_graphs_give_the_eager_engines_tokens(tiny_model_dirs, one_launch):
    d = tiny_model_dirs["llama"]
    want = engine(d, "torch_ref").generate(prompts(), GREEDY)
    eng = engine(d, "triton")
    pw = eng.worker.executor.piecewise
    assert pw is not None and pw.whole and pw.rows.shape[1] == 6
    if not one_launch:  # NOTE: the eager steps' decode rows take the decode kernel too
        eng.worker.executor.backends.extend.one_launch_max_kv_bytes = 0
    decode_rows = []  # each whole step's decode rows, as the static buffers held them
    fill = pw._fill_rows

    def watch(bt, num_decode):
        fill(bt, num_decode)
        decode_rows.append(int((pw.rows[3] > 0).sum()))
        assert decode_rows[-1] == num_decode and not pw.rows[1, :num_decode].any()

    pw._fill_rows = watch
    before = pw.num_whole_runs
    assert eng.generate(prompts(), GREEDY) == want
    # NOTE: one row after steps of four: the rows left from those must hold no work
    assert eng.generate(prompts()[3:], GREEDY) == want[3:]
    kinds = eng.worker.stats.kinds
    assert kinds["whole"].steps > 0 and pw.num_whole_runs - before == kinds["whole"].steps
    assert kinds["piecewise"].steps == 0  # NOTE: decode rows no longer send a step to pieces
    assert max(decode_rows) > 0, "some whole step carried decode rows beside a prompt"
    eng.check_integrity()
    assert eng.scheduler.num_free_pages == eng.scheduler.num_usable_pages
