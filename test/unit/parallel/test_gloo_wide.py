"""4 and 8 ranks over torch.distributed (gloo, CPU), spawned as in test_gloo_tp: a tiny
Llama at TP 4 (KV heads split one a rank, or replicated over 2 ranks; an odd
vocabulary) and DP attention with a tiny Qwen3-MoE's experts split over every rank
(DP 4, DP 2 x TP 2 and DP 8, `--ep-size` tp x dp), each DP group prefilling its own
prompts, equal one rank's prefill logits (float32); under DP 2 x TP 2 the TP ranks of
a group hold the same bits. MoE-TP and EP inside
one TP group of 4 and 8 ranks: test_gloo_moe."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_hf_model
from gloo_ranks import rank_dp_attention_logits, rank_tp_logits
from parallel_util import load_model, prefill_batch, prefill_logits, spawn_ranks

from gyrfalcon.layers.context import LayerContext
from gyrfalcon.layers.moe import SparseMoeBlock

DEADLINE_S = 120  # a whole spawned run: start-up, loads, collectives
# NOTE: ids < 250 (the odd vocabulary); 62 | 63, 125 | 126, 188 | 189 are its tp 4
# shard edges (63 rows a rank, the last with 61 ids and 2 padding rows)
TP_PROMPTS = [[5, 62, 63, 2, 249, 9, 125, 126, 7, 188, 189], [8, 1, 200, 45, 6], [127, 0, 3]]
TP_CHECKPOINTS = {
    # name: (make_tiny_hf_model arch, overrides)
    "llama-kv-split": ("llama", dict(num_attention_heads=8, num_key_value_heads=4)),
    "llama-kv-replicated": ("llama", {}),  # 4 query heads, 2 KV heads: each on 2 ranks
    "tied-odd-vocab": ("llama-tied", dict(vocab_size=250)),
}


def own_prompts(groups: int) -> list[list[list[int]]]:
    """DP group g's prompts: 2 + 3 g tokens, and a 4-token second prompt for odd g
    (every group a different count)."""
    return [
        [[(7 * g + 13 * i + 1) % 256 for i in range(2 + 3 * g)]] + [[g, 9, 200, 3]] * (g % 2)
        for g in range(groups)
    ]


def agreed_prompts(groups: int) -> list[list[list[int]]]:
    """6 tokens in every DP group, different ones."""
    return [[[(11 * g + 5 * i + 1) % 256 for i in range(6)]] for g in range(groups)]


@pytest.fixture(scope="module")
def tp_dirs(tmp_path_factory) -> dict[str, str]:
    dirs = {}
    for name, (arch, overrides) in TP_CHECKPOINTS.items():
        dirs[name] = str(tmp_path_factory.mktemp(f"tp4-{name}"))
        make_tiny_hf_model(dirs[name], arch, **overrides)
    return dirs


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory) -> str:
    """Qwen3-MoE: 8 experts of 32, top-3, layer 0 dense, then two MoE layers (an eager
    forward's count exchanges are then told from one a layer), 4 query heads, 2 KV heads."""
    path = str(tmp_path_factory.mktemp("dp-qwen3-moe"))
    make_tiny_hf_model(path, "qwen3-moe", mlp_only_layers=[0], num_hidden_layers=3)
    return path


@pytest.fixture(scope="module")
def tp4_outputs(tp_dirs, tmp_path_factory) -> list[dict]:
    """Each rank's {checkpoint: {"hidden", "logits", "embed_rows"}} of one TP=4 run."""
    out_dir = str(tmp_path_factory.mktemp("tp4-run"))
    spawn_ranks(rank_tp_logits, 4, out_dir, tp_dirs, TP_PROMPTS, timeout_s=DEADLINE_S)
    return [torch.load(f"{out_dir}/rank{r}.pt") for r in range(4)]


@pytest.mark.parametrize("name", list(TP_CHECKPOINTS))
def test_tp4_logits_equal_one_ranks(tp_dirs, tp4_outputs, name):
    with torch.inference_mode():
        model, want = prefill_logits(tp_dirs[name], LayerContext(), TP_PROMPTS)
    outs = [out[name] for out in tp4_outputs]
    vocab = model.cfg.vocab_size
    for out in outs:
        assert out["embed_rows"] == -(-vocab // 4)
        # every rank holds the same reduced stream and all the vocabulary's logits
        assert torch.equal(out["hidden"], outs[0]["hidden"])
        assert torch.equal(out["logits"], outs[0]["logits"])
    assert outs[0]["logits"].shape == (sum(map(len, TP_PROMPTS)), vocab)
    # NOTE: the all-reduce adds the four ranks' partial products: another float order
    torch.testing.assert_close(outs[0]["hidden"], want["hidden"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0]["logits"], want["logits"], atol=1e-4, rtol=1e-5)
    assert torch.equal(outs[0]["logits"].argmax(-1), want["logits"].argmax(-1))


def spawn_dp_attention(moe_dir: str, out_dir: str, dp: int, tp: int) -> list[dict]:
    """Each rank's output of dp x tp spawned ranks in DP groups of tp, the experts split
    over all of them (`rank_dp_attention_logits`)."""
    own, agreed = own_prompts(dp), agreed_prompts(dp)
    world = dp * tp
    spawn_ranks(
        rank_dp_attention_logits, world, out_dir, moe_dir, tp, own, agreed, timeout_s=DEADLINE_S
    )
    return [torch.load(f"{out_dir}/rank{r}.pt") for r in range(world)]


def check_dp_attention_equals_one_rank(ranks: list[dict], moe_dir: str, tp: int) -> None:
    """Every rank's logits of its DP group's prompts are one rank's, both passes."""
    dp = len(ranks) // tp
    ctx = LayerContext()
    model = load_model(moe_dir, ctx)
    cfg = model.cfg
    experts = (cfg.num_experts // len(ranks), 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    for r, out in enumerate(ranks):
        assert out["w13"] == experts  # E / (tp x dp) experts whole on each rank
        group = r // tp
        # NOTE: an eager forward exchanges row counts in each MoE layer, or in the
        # first alone under counts_once (the worker's eager path); graphs' in none
        moe_layers = sum(1 for m in model.modules() if isinstance(m, SparseMoeBlock))
        assert moe_layers > 1
        assert [out[n]["exchanges"] for n in ("own", "counted", "agreed")] == [moe_layers, 1, 0]
        own = own_prompts(dp)
        for name, prompts in (("own", own), ("counted", own), ("agreed", agreed_prompts(dp))):
            with torch.inference_mode():
                hidden = model(prefill_batch(model, prompts[group], ctx))
                logits = model.compute_logits(hidden)
            got = out[name]
            assert got["logits"].shape == (sum(map(len, prompts[group])), cfg.vocab_size)
            # NOTE: the expert all-reduce sums every rank's experts: another float order
            torch.testing.assert_close(got["hidden"], hidden, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(got["logits"], logits, atol=1e-4, rtol=1e-5)
            assert torch.equal(got["logits"].argmax(-1), logits.argmax(-1)), (r, name)


@pytest.fixture(scope="module")
def dp2_tp2(moe_dir, tmp_path_factory) -> list[dict]:
    return spawn_dp_attention(moe_dir, str(tmp_path_factory.mktemp("dp2-tp2")), 2, 2)


def test_dp4_attention_with_two_experts_a_rank_equals_one_rank(moe_dir, tmp_path):
    ranks = spawn_dp_attention(moe_dir, str(tmp_path), 4, 1)
    check_dp_attention_equals_one_rank(ranks, moe_dir, 1)


def test_dp2_tp2_attention_with_two_experts_a_rank_equals_one_rank(moe_dir, dp2_tp2):
    """Attention split within each DP group of 2, the experts over all 4 ranks."""
    check_dp_attention_equals_one_rank(dp2_tp2, moe_dir, 2)


def test_dp2_tp2_ranks_of_a_group_hold_the_same_stream(dp2_tp2):
    """TP ranks fill PLACEHOLDER ids from their own samples: their streams must be the
    same bits (as under plain TP), or a near tie feeds them different tokens."""
    for r in (1, 3):
        for name in ("own", "agreed"):
            assert torch.equal(dp2_tp2[r][name]["hidden"], dp2_tp2[r - 1][name]["hidden"])


@pytest.mark.wide
def test_dp8_attention_with_one_expert_a_rank_equals_one_rank(moe_dir, tmp_path):
    ranks = spawn_dp_attention(moe_dir, str(tmp_path), 8, 1)
    check_dp_attention_equals_one_rank(ranks, moe_dir, 1)
