"""Tiny Qwen3-MoE and Mixtral models served over two ranks (gloo) with their experts
split every way: MoE-TP (`--tp-size 2`), expert parallelism inside a TP group
(`--tp-size 2 --ep-size 2`) and DP attention with expert parallelism across the DP
groups (`--dp-size 2 --ep-size 2`: each group attends over its own requests, an idle
one runs dummy rows into the experts' collectives), and TP groups inside DP groups over
four ranks, answer a greedy batch exactly like the one-rank server, logprobs included,
nothing leaked on any rank."""

import pytest
from conftest import make_tiny_hf_model
from server_util import (
    alive,
    graph_forwards,
    kill_a_rank_mid_load,
    serve_greedy,
    start_server,
    step_kinds,
    stop_server,
)

PROMPTS = [[5, 9, 17, 33, 60], [7] * 12, list(range(3, 40))]


@pytest.fixture(scope="module", params=["qwen3-moe", "mixtral"])
def moe(request, tmp_path_factory):
    from gyrfalcon.bench.synthetic_tokenizer import make_synthetic_tokenizer

    root = tmp_path_factory.mktemp(request.param)
    model, tok = str(root / "model"), str(root / "tok")
    make_tiny_hf_model(model, request.param, num_hidden_layers=4)  # EAGLE3's aux layers
    make_synthetic_tokenizer(model, tok)
    return model, tok


def serve_batch(moe, tmp_path, *flags: str, prompts=PROMPTS, logprobs=True) -> tuple:
    """(per prompt (tokens, logprobs), page accounting, log, texts)."""
    model, tok = moe
    flags = ("--tokenizer", tok, "--page-size", "4", "--num-kv-pages", "128", *flags)
    got = serve_greedy(
        model, str(tmp_path / "server.log"), prompts, 12, "--cpu-threads", "1", *flags,
        logprobs=logprobs,
    )  # fmt: skip
    return got.out, got.info, got.log, got.texts


@pytest.fixture(scope="module")
def one_rank(moe, tmp_path_factory):
    return serve_batch(moe, tmp_path_factory.mktemp("one"))


FLAGS = {
    "moe_tp2": ["--tp-size", "2"],
    "tp2_ep2": ["--tp-size", "2", "--ep-size", "2"],
    "dp2_ep2": ["--dp-size", "2", "--ep-size", "2"],
    # the DP groups agree on one padded graph size a step (StepPlan.graph_rows), and
    # on one padded token count for the piecewise graphs of the other steps
    # (StepPlan.graph_tokens): no step runs eagerly with prompts of at most 37 tokens
    "dp2_ep2_graphs": ["--dp-size", "2", "--ep-size", "2", "--static-graph-replay"],
    # pieces of at most 16 tokens: a step with more on either group runs eagerly on both
    "dp2_ep2_graphs_16": [
        "--dp-size",
        "2",
        "--ep-size",
        "2",
        "--static-graph-replay",
        "--piecewise-cuda-graph-max-tokens",
        "16",
    ],  # fmt: skip
}


@pytest.mark.parametrize("flags", list(FLAGS.values()), ids=list(FLAGS))
def test_two_ranks_answer_like_one(moe, one_rank, tmp_path, flags):
    got, info, log, _ = serve_batch(moe, tmp_path, *flags)
    want, *_ = one_rank
    how = "expert parallel" if "--ep-size" in flags else "MoE-TP"
    assert f"rank 1: MoE experts split {how} over 2 ranks" in log
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
        assert tokens == want_tokens
        assert lps == pytest.approx(want_lps, abs=1e-4)
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info
    if "--dp-size" in flags:
        assert "2 worker rank(s)" in log
    if "--static-graph-replay" in flags:  # decode steps replayed, on both ranks
        assert all(graph_forwards(log, rank) > 0 for rank in (0, 1)), log[-3000:]
    if "--dp-size" in flags and "--static-graph-replay" in flags:
        # the prompts' steps (5, 12 and 37 tokens: each group's pads to its own size):
        # every group runs them as piecewise graphs of one size the plan agreed on (own
        # sizes would not gather: equal rows), or all eagerly where a group's step holds
        # more than 16 tokens
        kinds = [step_kinds(log, rank) for rank in (0, 1)]
        if "16" in flags:
            assert sum(k.get("eager", 0) for k in kinds) >= 1, kinds  # the 37 tokens'
        else:
            assert all(k.get("piecewise", 0) >= 1 and "eager" not in k for k in kinds), kinds


# NOTE: the layouts below are model-agnostic (graph agreement, four ranks, a dead rank);
# they run on Qwen3-MoE alone, as test/unit/parallel's four-rank checks do, while every
# two-rank layout above and the idle-group EAGLE3 test run on both families
QWEN3_ONLY = pytest.mark.parametrize("moe", ["qwen3-moe"], indirect=True)


def eagle3_flags(moe, tmp_path, layout=("--dp-size", "2", "--ep-size", "2")) -> list[str]:
    """EAGLE3 (a tiny random drafter: mostly 0 accepted) over `layout` (DP 2 + EP 2)."""
    from spec_util import make_drafter_for

    draft = make_drafter_for(moe[0], str(tmp_path / "draft"))
    return [
        *layout, "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", draft, "--speculative-num-steps", "2",
    ]  # fmt: skip


def test_eagle3_with_dp_attention_and_an_idle_group_is_lossless(moe, one_rank, tmp_path):
    """SPEC_DECODE.md bug class 6: EAGLE3 over two DP groups whose MoE layers share the
    experts. One request: one group verifies (a random drafter: mostly 0 accepted)
    while the other stays idle and runs dummy rows into every MoE collective of each
    verify step. No hang, and the tokens are the plain one-rank server's."""
    flags = eagle3_flags(moe, tmp_path)
    got, info, _, _ = serve_batch(moe, tmp_path, *flags, prompts=PROMPTS[:1])
    want, *_ = one_rank
    assert got[0][0] == want[0][0]
    assert got[0][1] == pytest.approx(want[0][1], abs=1e-4)
    assert info["usage"]["spec_verify_steps"] > 0
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info


@QWEN3_ONLY
@pytest.mark.parametrize(
    "prompts, logprobs, want_kinds",
    [
        # greedy rows without logprobs on both groups: the fused step (one replay: verify
        # and the draft round) on each, padded to the rows the groups agreed on
        (PROMPTS, False, ({"fused"}, {"fused"})),
        # logprobs take the general path: the VERIFY graph; the idle group replays a
        # dummy row of k + 1 tokens in the same graph size
        (PROMPTS[:1], True, ({"graph"}, {"idle"})),
    ],
    ids=["fused_both_groups", "verify_graph_idle_group"],
)
def test_eagle3_over_dp_groups_replays_agreed_verify_graphs(
    moe, one_rank, tmp_path, prompts, logprobs, want_kinds
):
    """Bug class 6 under (static) graph replay: both DP groups replay VERIFY graphs of one
    agreed size and width every steady step, an idle group's dummy row included, so the
    experts' gather needs no host exchange; outputs are the one-rank server's."""
    flags = [*eagle3_flags(moe, tmp_path), "--static-graph-replay"]
    got, info, log, texts = serve_batch(moe, tmp_path, *flags, prompts=prompts, logprobs=logprobs)
    want, _, _, want_texts = one_rank
    assert texts == want_texts[: len(prompts)]
    if logprobs:
        assert got[0][1] == pytest.approx(want[0][1], abs=1e-4)
    assert info["usage"]["spec_verify_steps"] > 0
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info
    for rank, kinds in enumerate(want_kinds):
        steps = step_kinds(log, rank)
        assert all(steps.get(k, 0) > 0 for k in kinds), (rank, steps, log[-3000:])
        assert graph_forwards(log, rank) > 0, log[-3000:]  # the idle rank's dummy rows too


@QWEN3_ONLY
@pytest.mark.parametrize("spec", [False, True], ids=["plain", "eagle3"])
def test_tp_groups_inside_dp_groups_with_the_experts_over_all_four_ranks(
    moe, one_rank, tmp_path, spec
):
    """`--tp-size 2 --dp-size 2 --ep-size 4` (4 gloo ranks): each DP group's attention
    split over its 2 TP ranks, every expert whole on one of the 4 ranks, under static
    graph replay. Plain: the one-rank server's tokens and logprobs. EAGLE3 (a random
    drafter): its text, every rank in fused spec steps. Nothing leaked."""
    layout = ("--tp-size", "2", "--dp-size", "2", "--ep-size", "4")
    flags = [*(eagle3_flags(moe, tmp_path, layout) if spec else layout), "--static-graph-replay"]
    got, info, log, texts = serve_batch(moe, tmp_path, *flags, logprobs=not spec)
    want, _, _, want_texts = one_rank
    assert "rank 3: MoE experts split expert parallel over 4 ranks" in log
    assert texts == want_texts
    if not spec:
        for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
            assert tokens == want_tokens
            assert lps == pytest.approx(want_lps, abs=1e-4)
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info
    kind = "fused" if spec else "graph"
    for rank in range(4):
        assert step_kinds(log, rank).get(kind, 0) > 0, (rank, log[-3000:])


@QWEN3_ONLY
def test_a_rank_killed_mid_decode_takes_the_dp_ep_server_down(moe, tmp_path):
    """SIGKILL the last worker of a DP 2 + EP 2 server while it decodes (the other rank
    waits in the experts' gather, a gloo collective): the server exits non-zero within
    30 s, names the dead rank, and no process is left."""
    import time

    model, tok = moe
    flags = ["--tokenizer", tok, "--dp-size", "2", "--ep-size", "2", "--cpu-threads", "1"]
    srv = start_server(model, str(tmp_path / "kill.log"), "--served-model-name", "m", *flags)
    body = {"model": "m", "prompt": PROMPTS * 2, "max_tokens": 400, "ignore_eos": True}
    try:
        code, took, kids = kill_a_rank_mid_load(srv, 2, body, 30)
    finally:
        stop_server(srv)
    assert code not in (0, None) and took < 30, srv.log()[-3000:]
    assert "exited unexpectedly" in srv.log(), srv.log()[-3000:]
    time.sleep(0.5)
    assert not [k for k in kids if alive(k)]
