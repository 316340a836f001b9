"""Qwen3-MoE and Mixtral end to end on the CPU (float32): tiny random HF checkpoints,
saved in the published per-expert layout and in transformers 5's fused one, give
HF's prefill logits and HF's greedy continuations through the engine; the published
configs parse to the published shapes; a rank under expert parallelism reads only
its experts; a checkpoint missing an expert is refused."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import make_tiny_hf_model
from parallel_util import load_model, prefill_batch
from safetensors.torch import load_file, save_file

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.engine import LocalEngine
from gyrfalcon.forward.parallel import ParallelContext
from gyrfalcon.ipc.messages import SamplingParams
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.layers.moe import SparseMoeBlock
from gyrfalcon.loader.hf_weights import iter_hf_weights
from gyrfalcon.models.llama import LlamaMLP
from gyrfalcon.models.registry import model_class

MODELS = os.path.join(os.path.dirname(__file__), "..", "..", "..", "benchmarks", "models")
PROMPTS = [[5, 17, 33, 2, 254, 9, 9, 41, 7, 100, 3], [8, 1, 200, 45, 6], [127, 128, 0, 3]]
CHECKPOINTS = {
    # name: (make_tiny_hf_model arch, save_original_format, overrides)
    "qwen3-moe": ("qwen3-moe", True, {}),
    "qwen3-moe-fused": ("qwen3-moe", False, {}),
    # raw top-k softmax weights; layer 0 a dense MLP of intermediate_size
    "qwen3-moe-dense-raw": ("qwen3-moe", True, dict(norm_topk_prob=False, mlp_only_layers=[0])),
    "mixtral": ("mixtral", True, {}),
    "mixtral-fused": ("mixtral", False, {}),
}


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory) -> dict[str, str]:
    dirs = {}
    for name, (arch, original, overrides) in CHECKPOINTS.items():
        dirs[name] = str(tmp_path_factory.mktemp(f"tiny-{name}"))
        make_tiny_hf_model(dirs[name], arch, save_original_format=original, **overrides)
    return dirs


def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, experts_implementation="eager"
    ).eval()


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_prefill_logits_equal_hfs(moe_dirs, name):
    ctx = LayerContext()
    model = load_model(moe_dirs[name], ctx)
    mlps = [type(layer.mlp) for layer in model.layers]
    assert mlps == ([LlamaMLP, SparseMoeBlock] if "dense" in name else [SparseMoeBlock] * 2)
    with torch.inference_mode():
        logits = model.compute_logits(model(prefill_batch(model, PROMPTS, ctx)))
        hf = hf_model(moe_dirs[name])
        want = torch.cat([hf(torch.tensor([p])).logits[0] for p in PROMPTS])
    assert logits.shape == want.shape == (sum(map(len, PROMPTS)), 256)
    torch.testing.assert_close(logits, want, atol=2e-5, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), want.argmax(-1))


def hf_greedy(model_dir: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    model, outs = hf_model(model_dir), []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        outs.append(out[0, len(p) :].tolist())
    return outs


@pytest.mark.parametrize("name", ["qwen3-moe", "qwen3-moe-dense-raw", "mixtral"])
def test_engine_greedy_generation_is_hfs(moe_dirs, name):
    """Batched, chunked prefill (8 tokens a step), then decode: the tokens HF picks."""
    d = moe_dirs[name]
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 17, 9, 30)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    args = ServerArgs(
        model=d, device="cpu", dtype="float32", page_size=4, num_kv_pages=64, chunked_prefill_size=8
    )
    eng = LocalEngine(args, d)
    assert eng.generate(prompts, greedy) == hf_greedy(d, prompts, greedy.max_tokens)
    eng.check_integrity()


def test_published_configs_parse_to_the_published_models():
    qwen = ModelConfig.from_dir(os.path.join(MODELS, "qwen3-30b-a3b"))
    assert (qwen.family, qwen.num_experts, qwen.num_experts_per_tok) == ("moe", 128, 8)
    assert (qwen.moe_intermediate_size, qwen.norm_topk_prob, qwen.qk_norm) == (768, True, True)
    assert qwen.moe_layers == tuple(range(48)) and not qwen.router_weights_fp32
    assert (qwen.num_heads, qwen.num_kv_heads, qwen.head_dim) == (32, 4, 128)
    mixtral = ModelConfig.from_dir(os.path.join(MODELS, "mixtral-8x7b"))
    assert (mixtral.family, mixtral.num_experts, mixtral.num_experts_per_tok) == ("moe", 8, 2)
    assert (mixtral.moe_intermediate_size, mixtral.norm_topk_prob) == (14336, True)
    assert mixtral.moe_layers == tuple(range(32)) and mixtral.router_weights_fp32
    assert not mixtral.qk_norm and mixtral.vocab_size == 32000
    # the parameter counts the model cards give: 30.5B and 46.7B
    for cfg, total in [(qwen, 30_532_122_624), (mixtral, 46_702_792_704)]:
        with torch.device("meta"):
            model = model_class(cfg)(cfg, LayerContext())
        assert sum(p.numel() for p in model.parameters()) == total


def test_qwen3_moe_dense_layers_follow_sparse_step_and_mlp_only_layers():
    hf = dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_experts_per_tok=2,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    # transformers 5 writes num_local_experts, the published checkpoints num_experts
    for spelling in ("num_experts", "num_local_experts"):
        cfg = ModelConfig.from_hf({**hf, spelling: 8})
        assert cfg.num_experts == 8 and cfg.moe_layers == (1, 5)
        assert not cfg.norm_topk_prob  # HF's default
    with pytest.raises(ValueError, match="9 experts per token out of 8"):
        ModelConfig.from_hf({**hf, "num_experts": 8, "num_experts_per_tok": 9})


def test_an_expert_parallel_rank_reads_and_holds_only_its_experts(moe_dirs):
    """EP 2 over Qwen3-MoE's 8 experts: rank 1 holds experts 4..7, never reads 0..3."""
    d = moe_dirs["qwen3-moe"]
    model = load_model(d, LayerContext(parallel=ParallelContext(1, 2, ep_size=2)))
    names = [n for n, _ in iter_hf_weights(d, show_progress=False, keep=model.keeps_weight)]
    experts = [int(n.split(".experts.")[1].split(".")[0]) for n in names if ".experts." in n]
    assert sorted(set(experts)) == [4, 5, 6, 7]
    assert "model.layers.1.mlp.gate.weight" in names  # the router is everyone's
    hf = hf_model(d).model.layers[1].mlp.experts  # transformers 5: fused in memory
    mine = model.layers[1].mlp.experts
    assert torch.equal(mine.w13, hf.gate_up_proj[4:]) and torch.equal(mine.w2, hf.down_proj[4:])


def test_a_checkpoint_missing_an_expert_is_refused(moe_dirs, tmp_path):
    src = moe_dirs["mixtral"]
    tensors = load_file(os.path.join(src, "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(os.path.join(src, "config.json"), tmp_path)
    with pytest.raises(ValueError, match=r"missing tensors for: \['layers.1.mlp.experts.w13'\]"):
        load_model(str(tmp_path), LayerContext())
