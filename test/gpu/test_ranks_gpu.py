"""Several GPU ranks over NCCL (two GPUs or more): a tiny float32 Llama served with
tensor parallelism (tp 2) and with two data-parallel groups, CUDA graphs on, answers
greedy batches exactly like one GPU, logprobs included; a bf16 tp-2 server on the
default backends serves a batch with nothing leaked."""

import pytest
import torch
from server_util import graph_forwards, serve_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
]

PROMPTS = [[5, 9, 17, 33, 60], [7] * 12, list(range(3, 40)), [100, 101, 7, 7, 9]]


@pytest.fixture(scope="module")
def tiny(tiny_gpu_dir, tmp_path_factory):
    from gyrfalcon.bench.synthetic_tokenizer import make_synthetic_tokenizer

    tok = str(tmp_path_factory.mktemp("tiny-tok"))
    make_synthetic_tokenizer(tiny_gpu_dir, tok)
    return tiny_gpu_dir, tok


def serve_batch(tiny, tmp_path, name: str, *flags: str) -> tuple[list, dict]:
    """Greedy completions of PROMPTS (all at once) from a server with `flags`: their
    (tokens, logprobs) and the server's page accounting after them."""
    model, tok = tiny
    flags = (
        "--device",
        "cuda",
        "--tokenizer",
        tok,
        "--page-size",
        "16",
        "--num-kv-pages",
        "256",
        *flags,
    )
    got = serve_greedy(model, str(tmp_path / f"{name}.log"), PROMPTS, 24, *flags)
    return got.out, got.info


@pytest.fixture(scope="module")
def one_gpu(tiny, tmp_path_factory):
    return serve_batch(tiny, tmp_path_factory.mktemp("one"), "one", "--attention-backend", "triton")


@pytest.mark.parametrize("flags", [["--tp-size", "2"], ["--dp-size", "2"]], ids=["tp2", "dp2"])
def test_two_gpus_answer_like_one(tiny, one_gpu, tmp_path, flags):
    got, info = serve_batch(tiny, tmp_path, "ranks", "--attention-backend", "triton", *flags)
    want, _ = one_gpu
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
        assert tokens == want_tokens
        assert lps == pytest.approx(want_lps, abs=1e-3)
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info


def test_bf16_tp2_on_the_default_backends_serves_and_leaks_nothing(tiny, tmp_path):
    got, info = serve_batch(tiny, tmp_path, "bf16", "--dtype", "bfloat16", "--tp-size", "2")
    assert [len(tokens) for tokens, _ in got] == [24] * len(PROMPTS)
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from conftest import make_tiny_hf_model

    from gyrfalcon.bench.synthetic_tokenizer import make_synthetic_tokenizer

    root = tmp_path_factory.mktemp("tiny-moe")
    model, tok = str(root / "model"), str(root / "tok")
    make_tiny_hf_model(model, "qwen3-moe", num_hidden_layers=4)
    make_synthetic_tokenizer(model, tok)
    return model, tok


MOE_FLAGS = {
    "dp2_ep2": ["--dp-size", "2", "--ep-size", "2"],
    "moe_tp2": ["--tp-size", "2"],
}


@pytest.mark.parametrize("flags", list(MOE_FLAGS.values()), ids=list(MOE_FLAGS))
def test_two_gpus_serve_a_moe_model_like_one_under_graphs(tiny_moe, tmp_path, flags):
    """The fused MoE kernel in CUDA graphs, float32: DP attention with the experts
    over both GPUs (the groups replay graphs of one agreed size, an idle group's dummy
    rows included) and MoE-TP answer like one GPU; decode steps replayed graphs."""
    one, _ = serve_batch(tiny_moe, tmp_path, "one", "--attention-backend", "triton")
    got, info = serve_batch(tiny_moe, tmp_path, "ranks", "--attention-backend", "triton", *flags)
    for (tokens, lps), (want_tokens, want_lps) in zip(got, one):
        assert tokens == want_tokens
        assert lps == pytest.approx(want_lps, abs=1e-3)
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info
    log = (tmp_path / "ranks.log").read_text()
    assert all(graph_forwards(log, rank) > 0 for rank in (0, 1)), log[-3000:]
