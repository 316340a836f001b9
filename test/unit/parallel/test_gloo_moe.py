"""MoE sharding over torch.distributed (gloo, CPU): Qwen3-MoE and Mixtral prefill
logits are one rank's whether the group splits each expert's intermediate dim
(MoE-TP) or the experts themselves (EP), over 2 ranks and, for Qwen3-MoE, 4 and 8;
under EP, ranks bringing their own tokens (DP attention) get back the MoE of their
rows, whether their counts are exchanged or agreed (graphs)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_hf_model
from gloo_ranks import rank_moe_logits
from parallel_util import load_model, prefill_batch, spawn_ranks

from gyrfalcon.layers.context import LayerContext

DEADLINE_S = 120  # a whole spawned run: start-up, loads, collectives
PROMPTS = [[5, 17, 33, 2, 254, 9, 9, 41, 7, 100, 3], [8, 1, 200, 45, 6], [127, 128, 0, 3]]
# name: make_tiny_hf_model arch (Qwen3-MoE: 8 experts of 32, top-3, layer 0 dense;
# Mixtral: 4 experts of 32, top-2)
CHECKPOINTS = {"qwen3-moe": "qwen3-moe", "mixtral": "mixtral"}


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory) -> dict[str, str]:
    dirs = {}
    for name, arch in CHECKPOINTS.items():
        dirs[name] = str(tmp_path_factory.mktemp(f"moe-{name}"))
        extra = dict(mlp_only_layers=[0]) if arch == "qwen3-moe" else {}
        make_tiny_hf_model(dirs[name], arch, **extra)
    return dirs


@pytest.fixture(scope="module")
def one_rank(checkpoint_dirs) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.nn.Module]]:
    """{name: (hidden, logits, model)} of one rank."""
    out = {}
    ctx = LayerContext()
    for name, model_dir in checkpoint_dirs.items():
        model = load_model(model_dir, ctx)
        with torch.inference_mode():
            hidden = model(prefill_batch(model, PROMPTS, ctx))
            out[name] = (hidden, model.compute_logits(hidden), model)
    return out


def spawn_run(world: int, dirs: dict[str, str], out_dir: str) -> list[dict]:
    spawn_ranks(rank_moe_logits, world, out_dir, dirs, PROMPTS, timeout_s=DEADLINE_S)
    return [torch.load(f"{out_dir}/rank{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def two_ranks(checkpoint_dirs, tmp_path_factory) -> list[dict]:
    return spawn_run(2, checkpoint_dirs, str(tmp_path_factory.mktemp("moe-2")))


@pytest.fixture(scope="module")
def eight_heads(tmp_path_factory) -> dict[str, str]:
    """Qwen3-MoE with 8 query heads (2 KV heads: replicated over 8 TP ranks)."""
    path = str(tmp_path_factory.mktemp("moe-8h"))
    make_tiny_hf_model(path, "qwen3-moe", num_attention_heads=8, mlp_only_layers=[0])
    return {"qwen3-moe": path}


@pytest.fixture(scope="module")
def four_ranks(checkpoint_dirs, tmp_path_factory) -> list[dict]:
    dirs = {"qwen3-moe": checkpoint_dirs["qwen3-moe"]}
    return spawn_run(4, dirs, str(tmp_path_factory.mktemp("moe-4")))


def check_ranks_equal_one_rank(ranks: list[dict], one_rank, name: str, mode: str) -> None:
    hidden, logits, model = one_rank[name]
    outs = [r[name, mode] for r in ranks]
    cfg, world = model.cfg, len(ranks)
    e, inter, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    want_w13 = (e, 2 * inter // world, h) if mode == "tp" else (e // world, 2 * inter, h)
    for out in outs:
        assert out["w13"] == want_w13  # each rank holds its share only
        # every rank holds the same reduced stream and all the vocabulary's logits
        assert torch.equal(out["hidden"], outs[0]["hidden"])
        assert torch.equal(out["logits"], outs[0]["logits"])
    # NOTE: the all-reduces add the ranks' partial sums: another float order
    torch.testing.assert_close(outs[0]["hidden"], hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[0]["logits"], logits, atol=1e-4, rtol=1e-5)
    assert torch.equal(outs[0]["logits"].argmax(-1), logits.argmax(-1))


@pytest.mark.parametrize("mode", ["tp", "ep"])
@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_two_ranks_logits_equal_one_ranks(two_ranks, one_rank, name, mode):
    check_ranks_equal_one_rank(two_ranks, one_rank, name, mode)


@pytest.mark.parametrize("mode", ["tp", "ep"])
def test_four_ranks_logits_equal_one_ranks(four_ranks, one_rank, mode):
    """Qwen3-MoE over 4 ranks: a quarter of each expert (8 rows) or 2 experts each."""
    check_ranks_equal_one_rank(four_ranks, one_rank, "qwen3-moe", mode)


def test_eight_ranks_logits_equal_one_ranks(eight_heads, tmp_path):
    """Qwen3-MoE over 8 ranks: one expert each (EP) or 4 intermediate rows (MoE-TP),
    one query head each with the KV heads replicated; the equal-rows gather too."""
    ranks = spawn_run(8, eight_heads, str(tmp_path))
    ctx = LayerContext()
    model = load_model(eight_heads["qwen3-moe"], ctx)
    with torch.inference_mode():
        hidden = model(prefill_batch(model, PROMPTS, ctx))
        one = {"qwen3-moe": (hidden, model.compute_logits(hidden), model)}
        for mode in ("tp", "ep"):
            check_ranks_equal_one_rank(ranks, one, "qwen3-moe", mode)
        block = model.layers[-1].mlp
        for out in ranks:
            x, got = out["rows_equal"]["x"], out["rows_equal"]["moe"]
            torch.testing.assert_close(got, block(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_with_their_own_tokens_get_their_rows_of_the_moe(
    request, one_rank, checkpoint_dirs, world
):
    """EP with rank-local tokens (2, 0, 8, 11 rows): each rank's rows, as one rank."""
    ranks = request.getfixturevalue({2: "two_ranks", 4: "four_ranks"}[world])
    last = list(checkpoint_dirs)[-1] if world == 2 else "qwen3-moe"
    block = one_rank[last][2].layers[-1].mlp
    for r, out in enumerate(ranks):
        x, got = out["rows"]["x"], out["rows"]["moe"]
        assert got.shape == x.shape == (0 if r == 1 else 3 * r + 2, block.gate.weight.shape[1])
        with torch.inference_mode():
            torch.testing.assert_close(got, block(x), atol=1e-5, rtol=1e-5)
            x, got = out["rows_equal"]["x"], out["rows_equal"]["moe"]  # the graphs' gather
            torch.testing.assert_close(got, block(x), atol=1e-5, rtol=1e-5)
