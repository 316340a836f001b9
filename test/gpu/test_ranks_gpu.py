"""Several GPU ranks over NCCL: a tiny float32 Llama served with tensor parallelism and
with data-parallel groups, CUDA graphs on, answers greedy batches exactly like one GPU,
logprobs included; a bf16 tp server on the default backends serves a batch with nothing
leaked; a tiny MoE likewise over DP attention + EP and MoE-TP, and its eager DP steps
build no Triton kernel while serving; EAGLE3 over each of those splits answers like
plain decoding on one GPU, its verify steps replayed as graphs on every rank; a rank killed mid-load takes the server down within 30 s, nothing left.

The rank count is GYRFALCON_GPU_RANKS (default 2; 4 or 8 on the wider machines): the
tiny models get max(4, ranks) attention heads so that tp splits them."""

import os
import time

import pytest
import torch
from server_util import (
    alive,
    graph_forwards,
    kill_a_rank_mid_load,
    serve_greedy,
    start_server,
    step_kinds,
    stop_server,
    wait_drained,
)

RANKS = int(os.environ.get("GYRFALCON_GPU_RANKS", "2"))
N = str(RANKS)
HEADS = max(4, RANKS)
DEATH_S = 30

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < RANKS, reason=f"needs {RANKS} GPUs"),
]

PROMPTS = [[5, 9, 17, 33, 60], [7] * 12, list(range(3, 40)), [100, 101, 7, 7, 9]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama with head_dim 64 (flashinfer has no kernels for 16) and HEADS
    heads, and its tokenizer."""
    from conftest import make_tiny_hf_model

    from gyrfalcon.bench.synthetic_tokenizer import make_synthetic_tokenizer

    root = tmp_path_factory.mktemp("tiny")
    model, tok = str(root / "model"), str(root / "tok")
    hidden = 64 * HEADS
    make_tiny_hf_model(
        model, "llama", hidden_size=hidden, intermediate_size=2 * hidden,
        num_attention_heads=HEADS,
    )  # fmt: skip
    make_synthetic_tokenizer(model, tok)
    return model, tok


def serve_batch(tiny, tmp_path, name: str, *flags: str) -> tuple[list, dict]:
    """Greedy completions of PROMPTS (all at once) from a server with `flags`: their
    (tokens, logprobs) and the server's page accounting after them."""
    got = serve_all(tiny, tmp_path, name, PROMPTS, True, *flags)
    return got.out, got.info


def cuda_flags(tok: str) -> tuple[str, ...]:
    return ("--device", "cuda", "--tokenizer", tok, "--page-size", "16", "--num-kv-pages", "256")


def serve_all(tiny, tmp_path, name: str, prompts: list, logprobs: bool, *flags: str):
    """`serve_greedy` of `prompts` (24 tokens each) on CUDA with the tests' KV pool."""
    model, tok = tiny[0], tiny[-1]
    log = str(tmp_path / f"{name}.log")
    return serve_greedy(model, log, prompts, 24, *cuda_flags(tok), *flags, logprobs=logprobs)


@pytest.fixture(scope="module")
def one_gpu(tiny, tmp_path_factory):
    return serve_batch(tiny, tmp_path_factory.mktemp("one"), "one", "--attention-backend", "triton")


@pytest.mark.parametrize(
    "flags",
    [["--tp-size", N], ["--tp-size", N, "--disable-custom-all-reduce"], ["--dp-size", N]],
    ids=[f"tp{N}", f"tp{N}-nccl", f"dp{N}"],
)
def test_gpu_ranks_answer_like_one(tiny, one_gpu, tmp_path, flags):
    got, info = serve_batch(tiny, tmp_path, "ranks", "--attention-backend", "triton", *flags)
    want, _ = one_gpu
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
        assert tokens == want_tokens
        assert lps == pytest.approx(want_lps, abs=1e-3)
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info
    # the TP group's small sums went through the one-shot kernel unless turned off
    one_shot = "one-shot all-reduce" in (tmp_path / "ranks.log").read_text()
    assert one_shot == (flags == ["--tp-size", N])


def test_bf16_tp_on_the_default_backends_serves_and_leaks_nothing(tiny, tmp_path):
    got, info = serve_batch(tiny, tmp_path, "bf16", "--dtype", "bfloat16", "--tp-size", N)
    assert [len(tokens) for tokens, _ in got] == [24] * len(PROMPTS)
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    from conftest import make_tiny_hf_model

    from gyrfalcon.bench.synthetic_tokenizer import make_synthetic_tokenizer

    root = tmp_path_factory.mktemp("tiny-moe")
    model, tok = str(root / "model"), str(root / "tok")
    # NOTE: 8 experts (EP up to 8), experts of 64 (MoE-TP 8: 8 rows a rank)
    make_tiny_hf_model(
        model, "qwen3-moe", num_hidden_layers=4, num_attention_heads=HEADS,
        moe_intermediate_size=64,
    )  # fmt: skip
    make_synthetic_tokenizer(model, tok)
    return model, tok


MOE_FLAGS = {
    f"dp{N}_ep{N}": ["--dp-size", N, "--ep-size", N],
    f"moe_tp{N}": ["--tp-size", N],
}


@pytest.mark.parametrize("flags", list(MOE_FLAGS.values()), ids=list(MOE_FLAGS))
def test_gpu_ranks_serve_a_moe_model_like_one_under_graphs(tiny_moe, tmp_path, flags):
    """The fused MoE kernel in CUDA graphs, float32: DP attention with the experts
    over every GPU (the groups replay graphs of one agreed size, idle groups' dummy
    rows included; the prompts' steps piecewise graphs of one agreed token count,
    none eager) and MoE-TP answer like one GPU; decode steps replayed graphs."""
    one, _ = serve_batch(tiny_moe, tmp_path, "one", "--attention-backend", "triton")
    got, info = serve_batch(tiny_moe, tmp_path, "ranks", "--attention-backend", "triton", *flags)
    for (tokens, lps), (want_tokens, want_lps) in zip(got, one):
        assert tokens == want_tokens
        assert lps == pytest.approx(want_lps, abs=1e-3)
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info
    log = (tmp_path / "ranks.log").read_text()
    assert all(graph_forwards(log, rank) > 0 for rank in range(RANKS)), log[-3000:]
    kinds = [step_kinds(log, rank) for rank in range(RANKS)]
    if "--dp-size" in flags:
        assert not any("eager" in k for k in kinds), kinds
    assert sum(k.get("piecewise", 0) + k.get("whole", 0) for k in kinds) > 0, kinds


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny float32 Llama (4 layers: EAGLE3's aux layers), a random EAGLE3 drafter
    for it, and a tokenizer: (target, drafter, tokenizer)."""
    from spec_util import make_pair

    from gyrfalcon.bench.synthetic_tokenizer import make_synthetic_tokenizer

    root = tmp_path_factory.mktemp("pair")
    target, draft = make_pair(root, hidden=64 * HEADS, heads=HEADS)
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


@pytest.mark.parametrize("flags", [["--tp-size", N], ["--dp-size", N]], ids=[f"tp{N}", f"dp{N}"])
def test_eagle3_over_gpu_ranks_answers_like_one_gpu_plain(pair, pair_plain, tmp_path, flags):
    """Greedy rows without logprobs: every steady step is the fused spec step (one
    replay of verify and the draft round) on every rank with rows (every TP rank; the
    DP groups that got a request); the text is plain decoding's on one GPU, and every
    page comes back."""
    want = pair_plain
    got = serve_all(pair, tmp_path, "spec", PROMPTS, False, *eagle3(pair[1]), *flags)
    assert got.texts == want.texts
    info = got.info
    assert info["usage"]["spec_verify_steps"] > 0
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info
    busy = RANKS if "--tp-size" in flags else min(RANKS, len(PROMPTS))
    assert all(step_kinds(got.log, r).get("fused", 0) > 0 for r in range(busy)), got.log[-3000:]


@pytest.fixture(scope="module")
def moe_pair(tiny_moe, tmp_path_factory):
    """The tiny MoE, a random EAGLE3 drafter of its shape, its tokenizer."""
    from spec_util import make_drafter_for

    model, tok = tiny_moe
    return model, make_drafter_for(model, str(tmp_path_factory.mktemp("moe-draft"))), tok


@pytest.mark.parametrize("spec", [False, True], ids=["plain", "eagle3"])
def test_dp_ep_eager_steps_build_no_triton_kernel_while_serving(moe_pair, tmp_path, spec):
    """DP + EP on triton, pieces of at most 16 tokens, prompt chunks of 24: 10 short
    prompts a group decode (or verify) when a 100-token prompt arrives, and while one
    group chunks it every step is eager on every group, so the others run ~10 decoding
    rows eagerly: int32 tables, RoPE inside the decode kernel, a split count the
    warm-up's eager steps (two rows) do not use. No rank builds a Triton kernel after
    its warm-up: each such build stalls a served step ~1 s (stop 50, four H200s)."""
    import re

    import httpx

    model, tok = moe_pair[0], moe_pair[-1]
    flags = [
        *(eagle3(moe_pair[1]) if spec else ["--attention-backend", "triton"]),
        "--dp-size", N, "--ep-size", N,
        "--piecewise-cuda-graph-max-tokens", "16", "--chunked-prefill-size", "24",
    ]  # fmt: skip
    srv = start_server(model, str(tmp_path / "eager.log"), "--served-model-name", "m",
                       *cuda_flags(tok), *flags)  # fmt: skip
    try:
        url, greedy = f"{srv.base_url}/v1/completions", {"temperature": 0, "ignore_eos": True}
        shorts = {"model": "m", "prompt": [[5, 9, 17]] * (10 * RANKS), "max_tokens": 200,
                  "stream": True, **greedy}  # fmt: skip
        with httpx.Client(timeout=300) as client, client.stream("POST", url, json=shorts) as r:
            chunks = (line for line in r.iter_lines() if line.startswith("data: "))
            next(chunks)  # NOTE: the short prompts are in and decoding
            long = {"model": "m", "prompt": [list(range(3, 103))], "max_tokens": 8, **greedy}
            answer = client.post(url, json=long)
            rest = list(chunks)
        assert answer.status_code == 200 and rest[-1] == "data: [DONE]", answer.text
        assert answer.json()["usage"]["completion_tokens"] == 8
        info = wait_drained(srv)
    finally:
        assert stop_server(srv) == 0, srv.log()[-3000:]
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info
    log = srv.log()
    kinds = [step_kinds(log, rank) for rank in range(RANKS)]
    assert all(k.get("eager", 0) > 0 for k in kinds), kinds
    assert all(k.get("fused" if spec else "graph", 0) > 0 for k in kinds), kinds
    for rank in range(RANKS):
        line = re.search(rf"rank {rank}: \d+ steps, .*", log)
        built = line and re.search(r"[^;]*built while serving[^;]*", line[0])
        assert built and built[0].strip() == "no Triton kernel built while serving", (
            rank, line and line[0], log[-3000:],
        )  # fmt: skip


@pytest.mark.parametrize(
    "prompts, logprobs, busy_kind",
    [
        (PROMPTS, False, "fused"),
        # one request with logprobs: the general path's VERIFY graph on one group, the
        # others idle, replaying a dummy row of k + 1 tokens in the agreed graph
        (PROMPTS[:1], True, "graph"),
    ],
    ids=["fused_groups", "verify_graph_idle_groups"],
)
def test_eagle3_over_dp_attention_and_ep_replays_agreed_graphs(
    moe_pair, tmp_path, prompts, logprobs, busy_kind
):
    """SPEC_DECODE.md bug class 6 on GPUs: EAGLE3 over DP groups whose MoE layers
    gather every rank's tokens. The groups replay one agreed VERIFY graph size every
    steady step (NCCL inside the graphs), idle groups' dummy rows included: no hang,
    plain one-GPU output, nothing leaked."""
    plain = ("--attention-backend", "triton")
    want = serve_all(moe_pair, tmp_path, "plain", prompts, logprobs, *plain)
    flags = [*eagle3(moe_pair[1]), "--dp-size", N, "--ep-size", N]
    got = serve_all(moe_pair, tmp_path, "spec", prompts, logprobs, *flags)
    assert got.texts == want.texts
    for (tokens, lps), (want_tokens, want_lps) in zip(got.out, want.out):
        assert tokens == want_tokens
        assert lps == pytest.approx(want_lps, abs=1e-3)
    info = got.info
    assert info["usage"]["spec_verify_steps"] > 0
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info
    for rank in range(RANKS):
        kind = busy_kind if rank < len(prompts) else "idle"  # a request a group, in order
        steps = step_kinds(got.log, rank)
        assert steps.get(kind, 0) > 0, (rank, steps, got.log[-3000:])
        assert graph_forwards(got.log, rank) > 0, got.log[-3000:]


def test_a_rank_killed_mid_load_takes_the_server_down(tiny_moe, tmp_path):
    """SIGKILL the last worker rank of a DP + EP MoE server while it decodes a batch (the
    other ranks sit in NCCL collectives inside graphs): the server exits non-zero within
    30 s, names the dead rank, and leaves no process behind."""
    model, tok = tiny_moe
    flags = ["--attention-backend", "triton", "--dp-size", N, "--ep-size", N]
    log = str(tmp_path / "kill.log")
    srv = start_server(model, log, "--served-model-name", "m", *cuda_flags(tok), *flags)
    body = {"model": "m", "prompt": PROMPTS * 4, "max_tokens": 400, "ignore_eos": True}
    try:
        code, took, kids = kill_a_rank_mid_load(srv, RANKS, body, DEATH_S)
    finally:
        stop_server(srv)
    assert code not in (0, None) and took < DEATH_S, srv.log()[-3000:]
    assert "exited unexpectedly" in srv.log(), srv.log()[-3000:]
    time.sleep(0.5)
    assert not [k for k in kids if alive(k)]
