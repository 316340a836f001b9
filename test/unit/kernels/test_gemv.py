"""Triton skinny GEMM (run in the CPU interpreter) against torch matmul."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: must precede every triton import

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gyrfalcon.kernels.gemv import (  # noqa: E402
    MAX_SKINNY_M,
    NORM_FUSED_MAX_K,
    norm_skinny_linear,
    skinny_linear,
)
from gyrfalcon.kernels.gemv_config import (  # noqa: E402
    _TUNED_BY_GPU,
    _TUNED_M1,
    GemvConfig,
    gemv_config,
)
from gyrfalcon.kernels.norm import fused_add_rmsnorm, rmsnorm  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)
# NOTE: triton's interpreter truncates float32 -> bfloat16 where the GPU rounds to
# nearest even, so bf16 checks here allow a few bf16 ulps (2**-7 relative each).
BF16_REL = 2**-5

FMA = GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, use_dot=False)
DOT = GemvConfig(block_n=16, block_k=32, num_warps=4, num_stages=2, use_dot=True)
CONFIGS = {"fma": FMA, "dot": DOT}


def assert_bf16_close(out, want):
    assert out.dtype == want.dtype == torch.bfloat16
    err = (out.float() - want.float()).abs()
    assert (err <= BF16_REL * want.float().abs().clamp_min(1.0)).all(), err.max()


def ref_silu_mul(x):
    # the unfused path: silu_and_mul rounds to the tensor dtype
    k = x.shape[-1] // 2
    return F.silu(x[:, :k]) * x[:, k:]


@pytest.mark.parametrize("path", ["fma", "dot"])
@pytest.mark.parametrize("M", [1, 3, 8, 16])
def test_matches_matmul_awkward_shapes(path, M):
    # N=40, K=72: neither is a multiple of the 16 x 32 blocks (partial last
    # program along N, masked tail along K); 3 K steps
    torch.manual_seed(M)
    x, w = torch.randn(M, 72), torch.randn(40, 72)
    out = skinny_linear(x, w, config=CONFIGS[path])
    assert out.shape == (M, 40) and out.dtype == torch.float32
    torch.testing.assert_close(out, x @ w.T, **TOL)


@pytest.mark.parametrize("path", ["fma", "dot"])
@pytest.mark.parametrize("M", [1, 5, 16])
def test_silu_mul_fused(path, M):
    torch.manual_seed(10 + M)
    K = 72
    x, w = torch.randn(M, 2 * K) * 2, torch.randn(40, K)
    out = skinny_linear(x, w, config=CONFIGS[path], act_silu_mul=True)
    # |out| ~ 20 here, and the kernel's exp differs from torch's in the last float32 bit
    torch.testing.assert_close(out, ref_silu_mul(x) @ w.T, atol=1e-4, rtol=1e-5)


def test_strided_x_rows_and_out_buffer():
    # x a row-strided view (e.g. a slice of a wider buffer); results land in `out`
    torch.manual_seed(3)
    buf = torch.randn(4, 100)
    x = buf[:, 10:82]
    assert not x.is_contiguous() and x.stride(-1) == 1
    w = torch.randn(33, 72)
    out = torch.full((4, 33), float("nan"))
    got = skinny_linear(x, w, config=DOT, out=out)
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, x @ w.T, **TOL)


@pytest.mark.parametrize("M", [1, 4])
def test_default_config(M):
    torch.manual_seed(4)
    x, w = torch.randn(M, 300), torch.randn(70, 300)
    torch.testing.assert_close(skinny_linear(x, w), x @ w.T, **TOL)


@pytest.mark.parametrize("path", ["fma", "dot"])
@pytest.mark.parametrize("act", [False, True])
def test_bf16(path, act):
    torch.manual_seed(5)
    M, N, K = 6, 40, 72
    x = torch.randn(M, 2 * K if act else K).to(torch.bfloat16)
    w = (torch.randn(N, K) * 0.3).to(torch.bfloat16)
    out = skinny_linear(x, w, config=CONFIGS[path], act_silu_mul=act)
    a = ref_silu_mul(x) if act else x  # bf16 activation, as the unfused path
    want = (a.float() @ w.float().T).to(torch.bfloat16)
    assert_bf16_close(out, want)


def test_rejects_bad_inputs():
    x, w = torch.randn(2, 64), torch.randn(8, 64)
    with pytest.raises(AssertionError):
        skinny_linear(x, torch.randn(8, 63))  # K mismatch
    with pytest.raises(AssertionError):
        skinny_linear(x, w, act_silu_mul=True)  # fused input must be [M, 2K]
    with pytest.raises(AssertionError):
        skinny_linear(torch.randn(MAX_SKINNY_M + 1, 64), w)
    with pytest.raises(AssertionError):
        skinny_linear(x, torch.randn(64, 8).t())  # w not contiguous
    with pytest.raises(AssertionError):
        skinny_linear(torch.randn(64, 2).t(), w)  # x last dim strided
    with pytest.raises(AssertionError):
        skinny_linear(x, w.to(torch.bfloat16))  # dtype mismatch
    with pytest.raises(AssertionError):
        GemvConfig(block_n=8, block_k=64, num_warps=4, num_stages=2, use_dot=True)  # dot < 16
    with pytest.raises(AssertionError):
        GemvConfig(block_n=12, block_k=64, num_warps=4, num_stages=2)


def pow2(v):
    return v >= 1 and v & (v - 1) == 0


SHAPES = [  # (N, K) of Llama-3.1-8B and SmolLM2-135M projections, and odd ones
    (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
    (960, 576), (576, 576), (3072, 576), (576, 1536), (40, 72), (1, 1),
]  # fmt: skip


def next_pow2(v):
    return 1 << (v - 1).bit_length()


@pytest.mark.parametrize("act", [False, True])
@pytest.mark.parametrize("num_sms", [8, 132])
def test_gemv_config_properties(num_sms, act):
    assert MAX_SKINNY_M <= 16
    for m in range(1, MAX_SKINNY_M + 1):
        for n, k in SHAPES:
            cfg = gemv_config(m, n, k, num_sms, act_silu_mul=act)
            assert pow2(cfg.block_n) and pow2(cfg.block_k) and pow2(cfg.num_warps), cfg
            assert 2 <= cfg.num_stages <= 6 and cfg.num_warps <= 8
            # no step wider than K needs (tensor cores need 16)
            assert cfg.block_k <= max(16, next_pow2(k)), (n, k, cfg)
            assert cfg.use_dot == (m > 1)  # M == 1: FMAs; more rows: tensor cores
            if cfg.use_dot:
                assert cfg.block_n >= 16 and cfg.block_k >= 16
                # the K pipeline fits in H100 shared memory with room to spare
                assert cfg.num_stages * (cfg.block_n + 16) * cfg.block_k * 2 <= 160 << 10
            else:
                # 16 weight elements (two 16-byte bf16 vectors) per thread and step,
                # 32 for a one-step grid of many programs (fewer warps: one wave)
                per_thread = cfg.block_n * cfg.block_k // (32 * cfg.num_warps)
                assert per_thread <= (32 if k <= cfg.block_k else 16), cfg
                # large N: the FMA programs fill every SM several times over
                if n >= 4096:
                    assert -(-n // cfg.block_n) >= 4 * num_sms, (m, n, cfg)
                # K <= 1024: one step covers all of it
                if k <= 1024:
                    assert cfg.block_k >= k, (n, k, cfg)


def test_gemv_config_examples():
    # Llama: 1024-wide FMA steps, 8 warps; SmolLM2 (K=576): one step over all of K
    assert gemv_config(1, 4096, 14336, 132) == GemvConfig(4, 1024, 8, 3, use_dot=False)
    assert gemv_config(1, 576, 576, 132) == GemvConfig(4, 1024, 8, 3, use_dot=False)
    # ... with 4 warps when the one-step grid has more than 4 programs per SM
    assert gemv_config(1, 3072, 576, 132).num_warps == 4
    assert gemv_config(1, 3072, 576, 1024).num_warps == 8
    assert gemv_config(1, 40, 72, 132) == GemvConfig(4, 128, 1, 3, use_dot=False)
    assert gemv_config(8, 4096, 4096, 132) == GemvConfig(64, 128, 4, 6, use_dot=True)
    assert gemv_config(2, 576, 576, 132, act_silu_mul=True) == GemvConfig(32, 256, 8, 4)
    assert gemv_config(16, 40, 8, 132).block_k == 16  # tl.dot's minimum


def test_tuned_shapes_only_at_one_row_on_an_h100():
    """The 8B's tp-2 projections take their swept configs at M = 1 on 132 SMs; other
    row counts and GPUs keep the rule, and the tp-1 shapes are not touched."""
    o_tp2 = (4096, 2048)
    assert gemv_config(1, *o_tp2, 132) == GemvConfig(64, 128, 4, 6, use_dot=True)
    assert gemv_config(1, *o_tp2, 132) != gemv_config(1, *o_tp2, 8)
    assert gemv_config(2, *o_tp2, 132) == gemv_config(2, *o_tp2, 8)
    assert gemv_config(1, 14336, 4096, 132) == GemvConfig(4, 512, 4, 4, use_dot=False)
    assert gemv_config(1, 4096, 7168, 132, act_silu_mul=True).block_k == 512
    assert gemv_config(1, 4096, 7168, 132).block_k == 1024  # the plain down is not tuned
    assert gemv_config(1, 4096, 4096, 132) == GemvConfig(4, 1024, 8, 3, use_dot=False)


def test_tuned_by_gpu_name_only_on_that_gpu():
    """An H200 takes its own swept configs for the 8B's tp-1 projections (before the
    132-SM table, which it shares with the H100); an H100, or no name, keeps the rule;
    shapes outside the table (the plain down, o at four rows) keep it on the H200 too."""
    h200, h100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
    qkv, o, gate_up, down = (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)
    assert gemv_config(1, *qkv, 132, gpu=h200) == GemvConfig(64, 128, 4, 5, use_dot=True)
    assert gemv_config(4, *qkv, 132, gpu=h200) == GemvConfig(64, 128, 4, 5, use_dot=True)
    assert gemv_config(1, *gate_up, 132, gpu=h200) == GemvConfig(4, 256, 2, 2, use_dot=False)
    assert gemv_config(1, *o, 132, gpu=h200).use_dot
    for m, shape in ((1, qkv), (4, qkv), (1, o), (1, gate_up)):
        assert gemv_config(m, *shape, 132, gpu=h100) == gemv_config(m, *shape, 132)
    assert gemv_config(4, *o, 132, gpu=h200) == gemv_config(4, *o, 132)
    fused = GemvConfig(8, 512, 8, 4, use_dot=False)
    assert gemv_config(1, *down, 132, act_silu_mul=True, gpu=h200) == fused
    assert gemv_config(1, *down, 132, act_silu_mul=True, gpu=h100).block_n == 4
    assert gemv_config(1, *down, 132, gpu=h200) == gemv_config(1, *down, 132)  # plain down
    # the name's whole word: an H200 NVL takes it, a GH200 (another memory) does not
    assert gemv_config(1, *qkv, 132, gpu="NVIDIA H200 NVL").use_dot
    assert gemv_config(1, *qkv, 132, gpu="NVIDIA GH200 480GB") == gemv_config(1, *qkv, 132)
    # the tp-2 shapes: the 132-SM table on both
    assert gemv_config(1, 4096, 2048, 132, gpu=h200) == gemv_config(1, 4096, 2048, 132)


# (config, act_silu_mul) of every tuned table's entries (their keys: (n, k, act, ...))
TUNED = {(cfg, key[2]) for t in (_TUNED_M1, *_TUNED_BY_GPU.values()) for key, cfg in t.items()}


@pytest.mark.parametrize("cfg,act", sorted(TUNED, key=repr), ids=repr)
def test_tuned_configs_compute_the_product(cfg, act):
    """Every config of the tuned tables runs and is exact (a small shape with a
    partial last program and K tail), at one row and at four; the fused down
    projection's with the activation."""
    torch.manual_seed(cfg.block_n + cfg.block_k)
    n, k = cfg.block_n + 3, cfg.block_k + 40
    for m in (1, 4):
        x, w = torch.randn(m, 2 * k if act else k), torch.randn(n, k)
        want = (ref_silu_mul(x) if act else x) @ w.T
        out = skinny_linear(x, w, config=cfg, act_silu_mul=act)
        torch.testing.assert_close(out, want, **TOL)


@pytest.mark.parametrize("M", [1, 3])
def test_default_config_fused(M):
    torch.manual_seed(6)
    x, w = torch.randn(M, 2 * 300), torch.randn(70, 300)
    out = skinny_linear(x, w, act_silu_mul=True)
    torch.testing.assert_close(out, ref_silu_mul(x) @ w.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("n,k", [(40, 72), (97, 576), (3, NORM_FUSED_MAX_K)])
def test_norm_folded_into_the_gemv_equals_norm_then_gemv(dtype, with_residual, n, k):
    """One launch gives what the norm kernel followed by skinny_linear gives."""
    torch.manual_seed(n + k)
    h = (3 * torch.randn(1, k)).to(dtype)
    res = torch.randn(1, k).to(dtype) if with_residual else None
    gamma = (torch.rand(k) + 0.5).to(dtype)
    w = (torch.randn(n, k) / k**0.5).to(dtype)
    h0, res0 = h.clone(), None if res is None else res.clone()
    y, res_out = norm_skinny_linear(h, res, gamma, 1e-5, w)
    assert torch.equal(h, h0) and (res is None or torch.equal(res, res0))  # inputs intact
    if with_residual:
        x, want_res = fused_add_rmsnorm(h.clone(), res.clone(), gamma, 1e-5)
        assert res_out.data_ptr() != res.data_ptr()
    else:
        x, want_res = rmsnorm(h, gamma, 1e-5), h
        assert res_out is h  # the residual stream starts at h itself
    assert torch.equal(res_out, want_res)
    want = skinny_linear(x, w, config=FMA)
    assert y.shape == (1, n) and y.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y, want, **TOL)
    else:
        assert_bf16_close(y, want)
    # and the norm really happened: not the product of the raw row
    raw = skinny_linear(h if res is None else (h + res), w, config=FMA)
    assert (y.float() - raw.float()).abs().max() > 10 * BF16_REL


def test_norm_skinny_linear_rejects_rows_it_cannot_fold():
    w = torch.randn(8, 16)
    with pytest.raises(AssertionError):
        norm_skinny_linear(torch.randn(2, 16), None, torch.ones(16), 1e-5, w)  # two rows
    with pytest.raises(AssertionError):
        big = NORM_FUSED_MAX_K + 1
        norm_skinny_linear(torch.randn(1, big), None, torch.ones(big), 1e-5, torch.randn(8, big))
