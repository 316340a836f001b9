"""The MoE layer's kernel warm-up on CUDA: after `SparseMoeBlock.warm_up_kernels`, a
step of any token count up to the bound (a prefill chunk, an eager DP gather) builds
no Triton kernel, so no request waits on a compile while the server runs."""

import pytest
import torch

from gyrfalcon.kernels.dispatch import KernelPolicy
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.layers.moe import SparseMoeBlock
from gyrfalcon.worker.compile_watch import CompileWatch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_moe_warm_up_builds_what_any_step_needs():
    # a shape of its own (E 24, k 3): kernels no other test built in this process
    h, e, k, inter = 256, 24, 3, 128
    with torch.device("cuda"):
        block = SparseMoeBlock(h, e, k, inter, True, False, LayerContext(KernelPolicy()))
    torch.nn.init.normal_(block.gate.weight, std=0.02)
    torch.nn.init.normal_(block.experts.w13, std=0.02)
    torch.nn.init.normal_(block.experts.w2, std=0.02)
    block = block.to(torch.bfloat16)
    block.warm_up_kernels(2048)
    watch = CompileWatch()
    # NOTE: an engine built earlier in this process keeps its own watch installed
    assert watch.install(), "another party holds Triton's JIT hooks"
    try:
        gen = torch.Generator(device="cuda").manual_seed(0)
        with torch.inference_mode():
            for t in (1, 5, 16, 33, 100, 257, 700, 1500, 2048):
                x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
                assert block(x).shape == (t, h)
        torch.cuda.synchronize()
    finally:
        watch.uninstall()
    assert not watch.counts, watch.summary()
