"""The EAGLE3 drafter on CUDA (fused kernels; triton and flashinfer attention) == the
drafter on the CPU (torch_ref, float32) through a spec-decode round (`run_draft_round`:
extend, decode, extend after a cached prefix), two ragged rows and one row (the
one-launch norm + GEMM paths); no forward writes into its input.

Run on the GPU machine: `python -m pytest -q -m gpu test/gpu/test_llama_eagle3_gpu.py`.
"""

import pytest
import torch
from eagle3_util import LENS, run_draft_round

from gyrfalcon.config.draft_config import DraftConfig
from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.layers.attention.registry import create_backend
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.models.registry import build_draft_model, build_model

pytestmark = pytest.mark.gpu

PS = 16


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory) -> tuple[str, str]:
    """A 4-layer tiny Llama of head_dim 64 (flashinfer's smallest) and a drafter for it."""
    from conftest import make_tiny_eagle3, make_tiny_hf_model

    target = str(tmp_path_factory.mktemp("eagle3-target"))
    make_tiny_hf_model(target, "llama", hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    drafter = str(tmp_path_factory.mktemp("eagle3-drafter"))
    make_tiny_eagle3(drafter, hidden_size=256, target_hidden_size=256, intermediate_size=512)
    return target, drafter


def build(pair_dirs, device: str, dtype: torch.dtype):
    target_dir, draft_dir = pair_dirs
    ctx, cfg = LayerContext(), ModelConfig.from_dir(target_dir)
    target = build_model(cfg, target_dir, dtype, torch.device(device), ctx, show_progress=False)
    return build_draft_model(
        DraftConfig.from_dir(draft_dir), cfg, draft_dir, dtype, torch.device(device), ctx,
        target.embed_tokens, show_progress=False,
    )  # fmt: skip


def backend_for(drafter, name: str):
    lyr = drafter.cfg.layer
    scale = lyr.head_dim**-0.5
    return create_backend(
        name, lyr.num_heads, lyr.num_kv_heads, lyr.head_dim, scale, drafter.ctx.kernels
    )


def assert_near(got: torch.Tensor, want: torch.Tensor, own: torch.Tensor | None, dtype) -> None:
    """got (CUDA) near want (CPU float32). float32: within TF32's error in the attention
    kernels' dots. bf16: rounding alone moves a position after the cached prefix by up
    to ~6% of the largest output of these random weights, as torch's own bf16 math on
    the CPU (`own`) shows: the kernels may stray at most twice as far as it does."""
    scale = want.abs().max().item()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=2e-3 * scale, rtol=2e-3)
        return
    assert own is not None
    err, own_err = (got - want).abs().max().item(), (own - want).abs().max().item()
    assert err <= max(3e-2 * scale, 2 * own_err), (err, own_err, scale)


@pytest.mark.parametrize(
    "backend,dtype",
    [("triton", torch.float32), ("triton", torch.bfloat16), ("flashinfer", torch.bfloat16)],
)
@pytest.mark.parametrize("lens", [LENS, ((6, 2),)], ids=["two-rows", "one-row"])
def test_drafter_on_cuda_matches_the_cpu(pair_dirs, backend, dtype, lens):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if backend == "flashinfer":
        pytest.importorskip("flashinfer")
    cpu = build(pair_dirs, "cpu", torch.float32)
    want = run_draft_round(cpu, backend_for(cpu, "torch_ref"), PS, lens)
    gpu = build(pair_dirs, "cuda", dtype)
    got = run_draft_round(gpu, backend_for(gpu, backend), PS, lens)
    own = None
    if dtype != torch.float32:  # NOTE: how far torch's own bf16 math strays (assert_near)
        ref = build(pair_dirs, "cpu", dtype)
        own = run_draft_round(ref, backend_for(ref, "torch_ref"), PS, lens)
    for i, (g, w) in enumerate(zip(got.outs, want.outs)):
        assert_near(g, w, None if own is None else own.outs[i], dtype)
    with torch.inference_mode():
        logits = gpu.compute_logits(got.outs[0].to("cuda", dtype)).float().cpu()
        want_logits = cpu.compute_logits(want.outs[0])
        own_logits = None if own is None else ref.compute_logits(own.outs[0].to(dtype)).float()
    assert_near(logits, want_logits, own_logits, dtype)
    ids = torch.arange(gpu.cfg.draft_vocab_size, device="cuda")
    assert torch.equal(gpu.to_target_ids(ids).cpu(), cpu.to_target_ids(ids.cpu()))
