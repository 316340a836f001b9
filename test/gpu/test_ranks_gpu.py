"""Several GPU ranks over NCCL (two GPUs or more): a tiny float32 Llama served with
tensor parallelism (tp 2) and with two data-parallel groups, CUDA graphs on, answers
greedy batches exactly like one GPU, logprobs included; a bf16 tp-2 server on the
default backends serves a batch with nothing leaked; a tiny MoE likewise over DP
attention + EP and MoE-TP; EAGLE3 over each of those splits answers like plain
decoding on one GPU, its verify steps replayed as graphs on every rank."""

import pytest
import torch
from server_util import graph_forwards, serve_greedy, step_kinds

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
    got = serve_all(tiny, tmp_path, name, PROMPTS, True, *flags)
    return got.out, got.info


def serve_all(tiny, tmp_path, name: str, prompts: list, logprobs: bool, *flags: str):
    """`serve_greedy` of `prompts` (24 tokens each) on CUDA with the tests' KV pool."""
    model, tok = tiny[0], tiny[-1]
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
    log = str(tmp_path / f"{name}.log")
    return serve_greedy(model, log, prompts, 24, *flags, logprobs=logprobs)


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


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny float32 Llama (4 layers: EAGLE3's aux layers), a random EAGLE3 drafter
    for it, and a tokenizer: (target, drafter, tokenizer)."""
    from spec_util import make_pair

    from gyrfalcon.bench.synthetic_tokenizer import make_synthetic_tokenizer

    root = tmp_path_factory.mktemp("pair")
    target, draft = make_pair(root, hidden=256)
    make_synthetic_tokenizer(target, str(root / "tok"))
    return target, draft, str(root / "tok")


def eagle3(draft: str) -> list[str]:
    return [
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft,
        "--speculative-num-steps", "3", "--attention-backend", "triton",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def pair_plain(pair, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pair-plain")
    return serve_all(pair, tmp, "plain", PROMPTS, False, "--attention-backend", "triton")


@pytest.mark.parametrize("flags", [["--tp-size", "2"], ["--dp-size", "2"]], ids=["tp2", "dp2"])
def test_eagle3_over_two_gpus_answers_like_one_gpu_plain(pair, pair_plain, tmp_path, flags):
    """Greedy rows without logprobs: every steady step is the fused spec step (one
    replay of verify and the draft round) on both ranks; the text is plain decoding's
    on one GPU, and every page comes back."""
    want = pair_plain
    got = serve_all(pair, tmp_path, "spec", PROMPTS, False, *eagle3(pair[1]), *flags)
    assert got.texts == want.texts
    info = got.info
    assert info["usage"]["spec_verify_steps"] > 0
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info
    assert all(step_kinds(got.log, rank).get("fused", 0) > 0 for rank in (0, 1)), got.log[-3000:]


@pytest.fixture(scope="module")
def moe_pair(tiny_moe, tmp_path_factory):
    """The tiny MoE, a random EAGLE3 drafter of its shape, its tokenizer."""
    from spec_util import make_drafter_for

    model, tok = tiny_moe
    return model, make_drafter_for(model, str(tmp_path_factory.mktemp("moe-draft"))), tok


@pytest.mark.parametrize(
    "prompts, logprobs, want_kinds",
    [
        (PROMPTS, False, ({"fused"}, {"fused"})),
        # one request with logprobs: the general path's VERIFY graph on one group, the
        # other idle, replaying a dummy row of k + 1 tokens in the agreed graph
        (PROMPTS[:1], True, ({"graph"}, {"idle"})),
    ],
    ids=["fused_both_groups", "verify_graph_idle_group"],
)
def test_eagle3_over_dp_attention_and_ep_replays_agreed_graphs(
    moe_pair, tmp_path, prompts, logprobs, want_kinds
):
    """SPEC_DECODE.md bug class 6 on GPUs: EAGLE3 over two DP groups whose MoE layers
    gather every rank's tokens. The groups replay one agreed VERIFY graph size every
    steady step (NCCL inside the graphs), an idle group's dummy rows included: no hang,
    plain one-GPU output, nothing leaked."""
    plain = ("--attention-backend", "triton")
    want = serve_all(moe_pair, tmp_path, "plain", prompts, logprobs, *plain)
    flags = [*eagle3(moe_pair[1]), "--dp-size", "2", "--ep-size", "2"]
    got = serve_all(moe_pair, tmp_path, "spec", prompts, logprobs, *flags)
    assert got.texts == want.texts
    for (tokens, lps), (want_tokens, want_lps) in zip(got.out, want.out):
        assert tokens == want_tokens
        assert lps == pytest.approx(want_lps, abs=1e-3)
    info = got.info
    assert info["usage"]["spec_verify_steps"] > 0
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info
    for rank, kinds in enumerate(want_kinds):
        steps = step_kinds(got.log, rank)
        assert all(steps.get(k, 0) > 0 for k in kinds), (rank, steps, got.log[-3000:])
        assert graph_forwards(got.log, rank) > 0, got.log[-3000:]
