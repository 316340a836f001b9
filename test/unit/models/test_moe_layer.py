"""The MoE layer on its own: the router picks and weighs experts exactly as HF's
(renormalized or not, model-dtype or float32 weights, ties), `moe_reference` is the
plain per-token sum (and HF's experts bit for bit), and a rank's share of the experts
(MoE-TP or EP) sums with the others' to the whole layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from parallel_util import ThreadGroup, run_ranks

from gyrfalcon.forward.parallel import ParallelContext
from gyrfalcon.kernels.dispatch import TORCH_REFERENCE
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.layers.moe import (
    MoeExperts,
    SparseMoeBlock,
    TopKRouter,
    moe_reference,
    padding_rows,
)

H, E, INTER = 64, 8, 32


def hf_router(arch: str, top_k: int, norm: bool, weight: torch.Tensor) -> torch.nn.Module:
    import transformers as tf

    if arch == "qwen3-moe":
        cfg = tf.Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=top_k)
        cfg.norm_topk_prob = norm
        router = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(cfg)
    else:
        cfg = tf.MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=top_k)
        router = tf.models.mixtral.modeling_mixtral.MixtralTopKRouter(cfg)
    router.weight.data.copy_(weight)
    return router.to(weight.dtype)


def our_router(arch: str, top_k: int, norm: bool, weight: torch.Tensor) -> TopKRouter:
    mixtral = arch == "mixtral"
    router = TopKRouter(H, E, top_k, renormalize=norm or mixtral, weights_fp32=mixtral)
    router.weight.data = weight.clone()
    return router


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "arch,norm", [("qwen3-moe", True), ("qwen3-moe", False), ("mixtral", True)]
)
def test_router_weights_and_ids_are_hfs(arch, norm, dtype):
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(E, H, generator=gen).to(dtype)
    x = (torch.randn(37, H, generator=gen) * 0.05).to(dtype)  # logits of std ~0.4
    with torch.no_grad():
        _, want_w, want_ids = hf_router(arch, 3, norm, weight)(x)
    got_w, got_ids = our_router(arch, 3, norm, weight)(x)
    assert torch.equal(got_ids, want_ids)
    assert got_w.dtype == want_w.dtype and torch.equal(got_w, want_w)
    # Mixtral's weights stay float32 in HF; Qwen3-MoE's are rounded to the model dtype
    assert got_w.dtype == (torch.float32 if arch == "mixtral" else dtype)
    probs = torch.softmax(F.linear(x, weight).float(), dim=-1)
    picked = probs.gather(1, got_ids)
    assert (picked.min(-1).values >= probs.topk(4).values[:, 3]).all()  # the 3 largest
    if norm:
        torch.testing.assert_close(got_w.float().sum(-1), torch.ones(37), atol=1e-2, rtol=0)
    else:  # the raw softmax probabilities: they sum to less than one
        torch.testing.assert_close(got_w, picked.to(got_w.dtype))
        assert (got_w.float().sum(-1) < 0.9).all()


def test_router_ties_pick_distinct_experts_with_equal_weights_as_hf():
    """Experts 1..4 score alike (identical gate rows): top-2 takes two of them, each
    with half the weight, and the same two HF's router takes."""
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(E, H, generator=gen) * 0.1
    weight[1:5] = torch.randn(H, generator=gen)  # the best four, all equal
    x = weight[1] * 0.5 + torch.randn(16, H, generator=gen) * 0.1  # they score highest
    for arch in ("qwen3-moe", "mixtral"):
        got_w, got_ids = our_router(arch, 2, True, weight)(x)
        with torch.no_grad():
            _, want_w, want_ids = hf_router(arch, 2, True, weight)(x)
        assert torch.equal(got_ids, want_ids) and torch.equal(got_w, want_w)
        assert ((got_ids >= 1) & (got_ids <= 4)).all()
        assert (got_ids[:, 0] != got_ids[:, 1]).all()
        assert torch.equal(got_w, torch.full_like(got_w, 0.5))


def naive_moe(x, w13, w2, weights, ids):
    """One token, one slot at a time."""
    out = torch.zeros_like(x)
    inter = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if not 0 <= e < w13.shape[0]:
                continue
            gate, up = w13[e, :inter] @ x[t], w13[e, inter:] @ x[t]
            out[t] += weights[t, j] * (w2[e] @ (F.silu(gate) * up))
    return out


def random_experts(seed: int, tokens: int, top_k: int = 3):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen)
    w13 = torch.randn(E, 2 * INTER, H, generator=gen) * 0.2
    w2 = torch.randn(E, H, INTER, generator=gen) * 0.2
    ids = torch.stack([torch.randperm(E, generator=gen)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=gen)
    return x, w13, w2, weights, ids


def test_moe_reference_is_the_per_token_sum():
    x, w13, w2, weights, ids = random_experts(0, 23)
    ids[3, 1] = -1  # slots naming no local expert (EP: another rank's) add nothing
    ids[5, 0] = E
    got = moe_reference(x, w13, w2, weights, ids)
    assert got.shape == x.shape and got.dtype == x.dtype
    torch.testing.assert_close(got, naive_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)
    empty = moe_reference(x[:0], w13, w2, weights[:0], ids[:0])
    assert empty.shape == (0, H)
    bf = moe_reference(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    assert bf.dtype == torch.bfloat16
    torch.testing.assert_close(bf.float(), got, atol=0.15, rtol=0.05)


def test_moe_reference_equals_hfs_experts_bit_for_bit():
    import transformers as tf

    x, w13, w2, weights, ids = random_experts(1, 19)
    cfg = tf.Qwen3MoeConfig(
        hidden_size=H, num_experts=E, moe_intermediate_size=INTER, experts_implementation="eager"
    )
    experts = tf.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(cfg)
    experts.gate_up_proj.data.copy_(w13)
    experts.down_proj.data.copy_(w2)
    with torch.no_grad():
        want = experts(x, ids, weights)
    assert torch.equal(moe_reference(x, w13, w2, weights, ids), want)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_ranks_shares_of_the_experts_sum_to_the_whole(ep):
    """4 ranks with MoE-TP (ep 1: a quarter of each expert's intermediate rows) or EP
    (ep 4: two experts each; ep 2 is rejected: EP spans the whole TP group)."""
    x, w13, w2, weights, ids = random_experts(2, 17)
    want = moe_reference(x, w13, w2, weights, ids)
    if ep == 2:
        with pytest.raises(ValueError, match="ep size 2"):
            ParallelContext(0, 4, ep_size=2)
        return
    total = torch.zeros_like(want)
    for r in range(4):
        ctx = LayerContext(TORCH_REFERENCE, ParallelContext(r, 4, ep_size=ep))
        experts = MoeExperts(H, E, INTER, ctx)
        experts.load("w13", w13)  # the fused HF layout of every expert
        experts.load("w2", w2)
        assert experts.w13.shape == ((E, 2 * INTER // 4, H) if ep == 1 else (2, 2 * INTER, H))
        total += experts(x, weights, ids)
    torch.testing.assert_close(total, want, atol=1e-5, rtol=1e-5)


def test_per_expert_tensors_load_into_the_fused_weight():
    """HF's per-expert gate/up/down land where the fused [gate | up] layout has them."""
    _, w13, w2, _, _ = random_experts(3, 1)
    ctx = LayerContext(TORCH_REFERENCE, ParallelContext(1, 2, ep_size=1))  # rows 16..31
    experts = MoeExperts(H, E, INTER, ctx)
    for e in range(E):
        experts.load("w13", w13[e, :INTER], f"gate:{e}")
        experts.load("w13", w13[e, INTER:], f"up:{e}")
        experts.load("w2", w2[e], f"down:{e}")
    mine = torch.cat([w13[:, 16:INTER], w13[:, INTER + 16 :]], dim=1)
    assert torch.equal(experts.w13, mine) and torch.equal(experts.w2, w2[:, :, 16:])
    with pytest.raises(ValueError, match="expert 3 up"):
        experts.load("w13", w13[3, :INTER, :32], "up:3")


@pytest.mark.parametrize("ep", [1, 2])
def test_ranks_with_their_own_tokens_get_their_rows_of_the_moe(ep):
    """DP-attention dispatch (threads as ranks): rank 0 brings 5 tokens, rank 1 none
    (an idle rank still joins the collectives); each gets back the MoE of its own
    tokens, as one rank computes them."""
    gen = torch.Generator().manual_seed(4)
    gate = torch.randn(E, H, generator=gen)
    _, w13, w2, _, _ = random_experts(5, 1)
    xs = [torch.randn(n, H, generator=gen) for n in (5, 0)]

    def block(parallel: ParallelContext) -> SparseMoeBlock:
        b = SparseMoeBlock(H, E, 3, INTER, True, False, LayerContext(TORCH_REFERENCE, parallel))
        b.gate.weight.data.copy_(gate)
        b.experts.load("w13", w13)
        b.experts.load("w2", w2)
        return b

    one = block(ParallelContext())
    group = ThreadGroup(2)
    ranks = [block(ParallelContext(r, 2, group.member(r), ep_size=ep)) for r in range(2)]
    seen: list[list[torch.Tensor]] = [[], []]
    for r, b in enumerate(ranks):  # the ids each rank's experts are given
        forward = b.experts.forward
        b.experts.forward = lambda x, w, ids, _f=forward, _r=r: (
            seen[_r].append(ids) or _f(x, w, ids)
        )
    outs = run_ranks(lambda r: ranks[r](xs[r], tokens_local=True), 2)
    for x, out in zip(xs, outs):
        assert out.shape == x.shape
        torch.testing.assert_close(out, one(x), atol=1e-5, rtol=1e-5)
    for ids in (seen[0][0], seen[1][0]):  # rank 1's 5 padding rows go to no expert
        assert ids.shape == (10, 3) and (ids[5:] == -1).all() and (ids[:5] >= 0).all()


def test_padding_rows_of_a_gather_are_each_ranks_rows_past_its_count():
    """Ranks bringing 2, 0 and 3 rows, padded to 3 each: rank r's block is rows
    [3 r, 3 r + 3), its own rows first."""
    got = padding_rows([2, 0, 3], 3, torch.device("cpu"))
    want = [False, False, True, True, True, True, False, False, False]
    assert got.tolist() == want
    assert not padding_rows([4, 4], 4, torch.device("cpu")).any()
    with pytest.raises(AssertionError):
        padding_rows([5, 1], 4, torch.device("cpu"))
