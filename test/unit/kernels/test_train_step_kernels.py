"""A drafter training step through the Triton kernels (CPU interpreter) equals the same
step through their torch references: train/ttt.py and train/objective.py hand the
kernels the layouts they expect (a [B, S] batch flattened to rows, one unroll step's
RoPE table slice, the union rows and their target rows), so the GPU's training step is
the CPU's up to float32 rounding: the loss, each step's hits, every gradient."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: must precede every triton import

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402
from conftest import make_tiny_hf_model  # noqa: E402

from gyrfalcon.config.model_config import ModelConfig  # noqa: E402
from gyrfalcon.kernels import soft_cross_entropy as sce  # noqa: E402
from gyrfalcon.kernels import train_layers  # noqa: E402
from gyrfalcon.layers.context import LayerContext  # noqa: E402
from gyrfalcon.models.registry import build_model  # noqa: E402
from gyrfalcon.train import objective  # noqa: E402
from gyrfalcon.train.args import TrainArgs  # noqa: E402
from gyrfalcon.train.drafter import build_drafter, draft_config_for  # noqa: E402
from gyrfalcon.train.evaluate import run_batch  # noqa: E402
from gyrfalcon.train.features import Features  # noqa: E402
from gyrfalcon.train.ttt import ttt_unroll  # noqa: E402

CPU = torch.device("cpu")
LENGTHS, PROMPTS = (21, 14, 9), (4, 6, 2)
# NOTE: peaked attention (sharp softmax) amplifies float32 rounding between the paths
OUT_TOL = dict(atol=2e-4, rtol=1e-3)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-target"))
    make_tiny_hf_model(path, "llama", num_hidden_layers=4)
    cfg = ModelConfig.from_dir(path)
    target = build_model(cfg, path, torch.float32, CPU, LayerContext(), show_progress=False)
    gen = torch.Generator().manual_seed(0)
    draft_ids = torch.randperm(cfg.vocab_size, generator=gen)[:64].sort().values
    drafter = build_drafter(draft_config_for(cfg, 64, "float32"), target, draft_ids, CPU, 0)
    with torch.no_grad():  # NOTE: norms off one, head off the target's: every one matters
        for name, p in drafter.named_parameters():
            if not name.startswith("embed_tokens."):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
        # NOTE: peaked attention, so a query's position (RoPE) shows in the outputs
        drafter.midlayer.self_attn.qkv_proj.weight.mul_(8.0)
    n, h = sum(LENGTHS), cfg.hidden_size
    final = torch.randn(n, h, generator=gen)
    features = Features(
        ids=torch.randint(0, cfg.vocab_size, (n,), generator=gen),
        aux=torch.randn(n, 3 * h, generator=gen),
        final=final,
        target_argmax=target.compute_logits(final).argmax(-1),
        starts=[0, LENGTHS[0], LENGTHS[0] + LENGTHS[1]],
        lengths=list(LENGTHS),
        prompt_lens=list(PROMPTS),
    )
    return target, drafter, features


def training_step(target, drafter, features):
    args = TrainArgs(prompts="p.jsonl", output_dir="out", device="cpu", ttt_steps=3).resolved()
    drafter.zero_grad(set_to_none=True)
    batch = features.batch([0, 1, 2], 8, args.ttt_steps)  # NOTE: padded 21 -> 24
    loss, results = run_batch(drafter, target, batch, args, CPU)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    with torch.no_grad():
        outs = ttt_unroll(drafter, batch.ids, batch.aux, args.ttt_steps)
    return loss.detach(), [(int(r.hits), r.rows) for r in results], grads, outs


def test_training_step_through_the_kernels_equals_the_torch_path(setup, monkeypatch):
    target, drafter, features = setup
    want = training_step(target, drafter, features)
    for name in ("rms_norm", "rotate_qkv", "silu_mul"):
        monkeypatch.setattr(train_layers, name, getattr(train_layers, f"{name}_triton"))
    monkeypatch.setattr(objective, "soft_cross_entropy", sce.soft_cross_entropy_triton)
    got = training_step(target, drafter, features)
    for j, (g, w) in enumerate(zip(got[3], want[3])):
        torch.testing.assert_close(g, w, **OUT_TOL, msg=lambda m, j=j: f"unroll step {j}: {m}")
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    assert got[1] == want[1] and want[1][0][1] == sum(n - p for n, p in zip(LENGTHS, PROMPTS))
    assert got[2].keys() == want[2].keys() and len(want[2]) > 5
    for name, g in want[2].items():
        torch.testing.assert_close(got[2][name], g, atol=1e-5, rtol=1e-4, msg=name)
