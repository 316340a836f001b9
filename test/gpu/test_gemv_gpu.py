"""The skinny GEMM (decode-sized linear layers) on CUDA, against cuBLAS in float32.

Run on the GPU machine: `python -m pytest test/gpu -m gpu -q`.
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

# (N, K): Llama-3.1-8B qkv / o / gate_up / down (the first three take configs of their
# own on an H200), SmolLM2 qkv / down, and a ragged shape
SHAPES = [
    (6144, 4096),
    (4096, 4096),
    (28672, 4096),
    (4096, 14336),
    (960, 576),
    (576, 1536),
    (1000, 200),
]


@pytest.fixture(scope="module")
def gemv():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from gyrfalcon.kernels import gemv

    assert type(gemv._skinny_gemm_kernel).__name__ != "InterpretedFunction"
    return gemv


def reference(x, w, act=False):
    x = x.float()
    if act:  # silu_and_mul's rounding: silu to the dtype, then the product to the dtype
        d = x.shape[1] // 2
        g = F.silu(x[:, :d]).to(w.dtype).float()
        x = (g * x[:, d:]).to(w.dtype).float()
    return x @ w.float().T


@pytest.mark.parametrize("m", [1, 3, 8, 16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_matches_float32_product(gemv, m, n, k):
    torch.manual_seed(m * n + k)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
    got = gemv.skinny_linear(x, w)
    want = reference(x, w)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # fp32 accumulation: only the final bf16 rounding (2**-8 relative) separates them
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=2**-7)
    cublas = F.linear(x, w).float()
    assert (got.float() - want).abs().mean() <= 1.5 * (cublas - want).abs().mean() + 1e-6


@pytest.mark.parametrize("n,k", [(4096, 14336), (576, 1536)])
def test_fused_silu_mul_down_projection(gemv, n, k):
    torch.manual_seed(n)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(torch.bfloat16)
    gate_up = (2 * torch.randn(1, 2 * k, device="cuda")).to(torch.bfloat16)
    got = gemv.skinny_linear(gate_up, w, act_silu_mul=True)
    torch.testing.assert_close(got.float(), reference(gate_up, w, act=True), atol=1e-2, rtol=2**-7)


def test_linear_layers_route_decode_batches_and_replay_in_a_graph(gemv):
    from gyrfalcon.layers.context import LayerContext
    from gyrfalcon.layers.linear import ColumnParallelLinear, RowParallelLinear

    torch.manual_seed(3)
    ctx = LayerContext()  # fused kernels, PDL where supported (the production default)
    col = ColumnParallelLinear(576, [576, 192, 192], ctx).cuda().to(torch.bfloat16)
    down = RowParallelLinear(1536, 576, ctx).cuda().to(torch.bfloat16)
    for p in (col.weight, down.weight):
        p.data.normal_(std=0.05)
    x = torch.randn(16, 576, device="cuda").to(torch.bfloat16)
    gu = torch.randn(1, 3072, device="cuda").to(torch.bfloat16)
    # decode-sized batches take the skinny kernel, larger ones cuBLAS: bit for bit
    assert torch.equal(col(x[:5]), gemv.skinny_linear(x[:5], col.weight))
    big = torch.randn(17, 576, device="cuda").to(torch.bfloat16)
    assert torch.equal(col(big), F.linear(big, col.weight))
    assert torch.equal(
        down.forward_silu_mul(gu), gemv.skinny_linear(gu, down.weight, act_silu_mul=True)
    )

    static_x, static_gu = x[:4].clone(), gu.clone()
    eager = (col(static_x), down.forward_silu_mul(static_gu))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = (col(static_x), down.forward_silu_mul(static_gu))
    static_x.copy_(x[8:12])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], col(x[8:12])) and torch.equal(out[1], eager[1])


@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("n", [960, 3072])
def test_norm_folded_into_the_gemv(gemv, with_residual, n):
    """SmolLM2's qkv / gate_up at batch 1: add+RMSNorm and the projection in one launch
    equal the norm kernel then the skinny GEMM (up to the norm's reduction order)."""
    from gyrfalcon.kernels.norm import fused_add_rmsnorm, rmsnorm

    torch.manual_seed(n)
    k, bf = 576, torch.bfloat16
    h = (3 * torch.randn(1, k, device="cuda")).to(bf)
    res = torch.randn(1, k, device="cuda").to(bf) if with_residual else None
    gamma = (torch.rand(k, device="cuda") + 0.5).to(bf)
    w = (torch.randn(n, k, device="cuda") / k**0.5).to(bf)
    y, res_out = gemv.norm_skinny_linear(h, res, gamma, 1e-5, w)
    if with_residual:
        x, want_res = fused_add_rmsnorm(h.clone(), res.clone(), gamma, 1e-5)
    else:
        x, want_res = rmsnorm(h, gamma, 1e-5), h
    assert torch.equal(res_out, want_res)
    want = gemv.skinny_linear(x, w)
    torch.testing.assert_close(y.float(), want.float(), atol=2e-2, rtol=2**-7)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        g_y, g_res = gemv.norm_skinny_linear(h, res, gamma, 1e-5, w)
    h.copy_((3 * torch.randn(1, k, device="cuda")).to(bf))
    graph.replay()
    torch.cuda.synchronize()
    e_y, e_res = gemv.norm_skinny_linear(h, res, gamma, 1e-5, w)
    assert torch.equal(g_y, e_y) and torch.equal(g_res, e_res)
