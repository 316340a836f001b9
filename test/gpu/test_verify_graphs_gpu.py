"""VERIFY through real CUDA graphs (k + 1 query tokens per row on a cached prefix) ==
the eager VERIFY forward, for the triton and flashinfer backends, with a batch padded
3 -> 4 (and 1 -> 2) and a KV pool of a few pages.

Run on the GPU machine: `python -m pytest -q -m gpu test/gpu/test_verify_graphs_gpu.py`.
"""

import pytest
import torch
from verify_util import build_executor, make_case, prefill_prefixes, verify, whole_row_logits

from gyrfalcon.ipc.messages import ForwardMode

pytestmark = pytest.mark.gpu

PS = 16
# prefixes at page edges and across pages; the last case pads 1 -> 2
PREFIXES = [[1, PS - 1, 2 * PS + 7], [PS, 3, 40], [23]]


def close_in_bf16(got: torch.Tensor, want: torch.Tensor) -> list[bool]:
    """bf16: graph and eager kernels may differ in split-KV and GEMM choices (as in
    test_graphs_gpu): logits within 2% of their scale; returns per token whether the
    argmax agrees (>= 90% must, over all cases)."""
    got, want = got.float(), want.float()
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, atol=2e-2 * scale, rtol=2e-2)
    return (got.argmax(-1) == want.argmax(-1)).tolist()


@pytest.mark.parametrize(
    "backend,dtype",
    [("triton", "float32"), ("triton", "bfloat16"), ("flashinfer", "bfloat16")],
)
@pytest.mark.parametrize("k", [1, 3])
def test_verify_graph_replay_matches_eager(tiny_gpu_dir, backend, dtype, k):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    need = max(sum(-(-(n + k + 1) // PS) for n in prefixes) for prefixes in PREFIXES)
    ex, context = build_executor(
        tiny_gpu_dir,
        device="cuda",
        dtype=dtype,
        attention_backend=backend,
        decode_attention_backend=backend,
        page_size=PS,
        num_kv_pages=need + 1,  # the rows' pages and the dummy page: capture needs no more
        cuda_graph_max_bs=4,
        cuda_graph_bs="2,4",
    )
    ex.setup_graphs(context, verify_tokens_per_row=k + 1)
    assert ex.graphs is not None and ex.graphs.mode == "cuda"
    verify_keys = sorted(key for key in ex.graphs.graphs if key.mode == ForwardMode.VERIFY)
    assert [(key.batch_size, key.tokens_per_row) for key in verify_keys] == [(2, k + 1), (4, k + 1)]
    agree: list[bool] = []  # bf16: argmax agreement of every token of every case
    for seed, prefix_lens in enumerate(PREFIXES):
        case = make_case(ex, prefix_lens, k, seed=seed)
        prefill_prefixes(ex, case)
        eager = verify(ex, case, graphs=False)
        runs = ex.graphs.num_runs
        replay = verify(ex, case, graphs=True)
        torch.cuda.synchronize()
        assert ex.graphs.num_runs == runs + 1, "the VERIFY step replayed a graph"
        n = len(prefix_lens) * (k + 1)
        assert replay.logits.shape == eager.logits.shape == (n, ex.cfg.vocab_size)
        assert torch.isfinite(replay.logits.float()).all()
        assert torch.equal(replay.argmax, replay.logits.argmax(-1))
        whole = whole_row_logits(ex, case)
        if dtype == "float32":
            torch.testing.assert_close(replay.logits, eager.logits, atol=1e-4, rtol=1e-4)
            assert torch.equal(replay.argmax, eager.logits.argmax(-1))
            torch.testing.assert_close(whole, eager.logits, atol=1e-4, rtol=1e-4)
        else:
            agree += close_in_bf16(replay.logits, eager.logits)
            agree += close_in_bf16(whole, eager.logits)
    if agree:
        assert sum(agree) >= 0.9 * len(agree), f"{sum(agree)} of {len(agree)} argmax agree"


def test_default_server_captures_decode_only(tiny_gpu_dir):
    """Without the opt-in, graphs are DECODE keys alone (the server's behaviour)."""
    ex, _ = build_executor(
        tiny_gpu_dir,
        device="cuda",
        dtype="bfloat16",
        attention_backend="triton",
        decode_attention_backend="triton",
        page_size=PS,
        num_kv_pages=64,
        cuda_graph_max_bs=8,
    )
    assert ex.graphs is not None and ex.graphs.mode == "cuda"
    assert {key.mode for key in ex.graphs.graphs} == {ForwardMode.DECODE}
    assert sorted(key.batch_size for key in ex.graphs.graphs) == [1, 2, 4, 8]
