"""Triton fused kernels (run in the CPU interpreter) against the torch layers."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: must precede every triton import

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402

from gyrfalcon.kernels.activation import silu_and_mul  # noqa: E402
from gyrfalcon.kernels.dispatch import TORCH_REFERENCE  # noqa: E402
from gyrfalcon.kernels.kv_store import store_kv  # noqa: E402
from gyrfalcon.kernels.norm import fused_add_rmsnorm, rmsnorm  # noqa: E402
from gyrfalcon.kernels.rotary import (  # noqa: E402
    build_cos_sin_cache,
    rotary_and_store,
    rotary_inplace,
)
from gyrfalcon.layers import activation as ref_act  # noqa: E402
from gyrfalcon.layers.context import LayerContext  # noqa: E402
from gyrfalcon.layers.norm import RMSNorm  # noqa: E402
from gyrfalcon.layers.rotary import RotaryEmbedding  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)
REF = LayerContext(kernels=TORCH_REFERENCE)  # the layers' torch code: the reference
# NOTE: triton's interpreter truncates float32 -> bfloat16 where the GPU rounds to
# nearest even, so bf16 checks here allow a few bf16 ulps (2**-7 relative each);
# the GPU tests check bf16 rounding exactly.
BF16_REL = 2**-5


def assert_bf16_close(out, want):
    assert out.dtype == want.dtype == torch.bfloat16
    err = (out.float() - want.float()).abs()
    assert (err <= BF16_REL * want.float().abs().clamp_min(1.0)).all(), err.max()


LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def ref_norm(hidden, eps=1e-6, dtype=torch.float32):
    norm = RMSNorm(hidden, eps, REF)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden) * 0.5 + 1.0)
    return norm.to(dtype)


@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("H,block", [(64, None), (576, None), (576, 256)])
def test_rmsnorm_matches_torch(T, H, block):
    torch.manual_seed(T * H)
    norm = ref_norm(H)
    x = torch.randn(T, H) * 3.0
    out = rmsnorm(x, norm.weight.data, norm.eps, block_size=block)
    assert out.dtype == x.dtype and out.shape == x.shape
    torch.testing.assert_close(out, norm(x), **TOL)


def test_rmsnorm_per_head_on_strided_qkv_view():
    # qk-norm case: q is [T, Hq, D] sliced out of a fused qkv output
    torch.manual_seed(1)
    T, Hq, Hk, D = 37, 4, 2, 64
    norm = ref_norm(D)
    qkv = torch.randn(T, (Hq + 2 * Hk) * D)
    q = qkv[:, : Hq * D].view(T, Hq, D)
    assert not q.is_contiguous()
    want = norm(q)
    out = rmsnorm(q, norm.weight.data, norm.eps)
    torch.testing.assert_close(out, want, **TOL)
    k_before = qkv[:, Hq * D :].clone()
    rmsnorm(q, norm.weight.data, norm.eps, out=q)  # in place, into the fused buffer
    torch.testing.assert_close(qkv[:, : Hq * D].view(T, Hq, D), want, **TOL)
    assert torch.equal(qkv[:, Hq * D :], k_before)


def test_rmsnorm_and_fused_add_bf16():
    torch.manual_seed(2)
    norm = ref_norm(576, dtype=torch.bfloat16)
    x = (torch.randn(37, 576) * 2).to(torch.bfloat16)
    res = (torch.randn(37, 576) * 2).to(torch.bfloat16)
    assert_bf16_close(rmsnorm(x, norm.weight.data, norm.eps), norm(x))
    normed, new_res = fused_add_rmsnorm(x, res, norm.weight.data, norm.eps, inplace=False)
    assert_bf16_close(new_res, x + res)
    assert_bf16_close(normed, norm(x + res))


@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("block", [None, 256])
def test_fused_add_rmsnorm_in_place(T, block):
    torch.manual_seed(T)
    H = 576
    norm = ref_norm(H)
    x, res = torch.randn(T, H), torch.randn(T, H) * 4
    want_res = res + x
    want = norm(want_res)
    x_buf, res_buf = x.clone(), res.clone()
    normed, new_res = fused_add_rmsnorm(
        x_buf, res_buf, norm.weight.data, norm.eps, block_size=block
    )
    assert normed.data_ptr() == x_buf.data_ptr() and new_res.data_ptr() == res_buf.data_ptr()
    torch.testing.assert_close(new_res, want_res, atol=0, rtol=0)
    torch.testing.assert_close(normed, want, **TOL)


def test_fused_add_rmsnorm_out_of_place_keeps_inputs():
    torch.manual_seed(3)
    norm = ref_norm(576)
    x, res = torch.randn(37, 576), torch.randn(37, 576)
    x0, res0 = x.clone(), res.clone()
    normed, new_res = fused_add_rmsnorm(x, res, norm.weight.data, norm.eps, inplace=False)
    torch.testing.assert_close(x, x0, atol=0, rtol=0)
    torch.testing.assert_close(res, res0, atol=0, rtol=0)
    torch.testing.assert_close(new_res, x0 + res0, atol=0, rtol=0)
    torch.testing.assert_close(normed, norm(x0 + res0), **TOL)


@pytest.mark.parametrize("scaling", [None, LLAMA3])
def test_cos_sin_cache_is_exactly_the_reference_table(scaling):
    rope = RotaryEmbedding(64, 500000.0, scaling, 4096, REF)
    cache = build_cos_sin_cache(rope.inv_freq, 300)
    freqs = torch.arange(300).float()[:, None] * rope.inv_freq[None, :]
    assert cache.shape == (300, 64) and cache.dtype == torch.float32
    assert torch.equal(cache[:, :32], freqs.cos()) and torch.equal(cache[:, 32:], freqs.sin())


@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("D,scaling", [(64, None), (128, LLAMA3)])
def test_rotary_inplace_on_split_qkv(T, D, scaling):
    torch.manual_seed(T + D)
    Hq, Hk, max_pos = 6, 2, 4096
    rope = RotaryEmbedding(D, 10000.0, scaling, 4096, REF)
    cache = build_cos_sin_cache(rope.inv_freq, max_pos)
    qkv = torch.randn(T, (Hq + 2 * Hk) * D)
    positions = torch.randint(0, max_pos, (T,))
    positions[0] = max_pos - 1
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    q, k, v = q.view(T, Hq, D), k.view(T, Hk, D), v.view(T, Hk, D)
    want_q, want_k = rope(positions, q.clone(), k.clone())
    v0 = v.clone()
    out_q, out_k = rotary_inplace(q, k, positions, cache)
    assert out_q.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qkv[:, : Hq * D].view(T, Hq, D), want_q, **TOL)
    torch.testing.assert_close(qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D), want_k, **TOL)
    assert torch.equal(v, v0)  # the kernel must not run past k into v


@pytest.mark.parametrize("T,D", [(1, 64), (13, 128)])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float8_e4m3fn])
def test_rotary_and_store_equals_rotary_then_store(T, D, cache_dtype):
    """One launch does what rotary_inplace then store_kv do, on views of a fused qkv."""
    torch.manual_seed(T * D)
    Hq, Hk, S = 6, 2, 64
    rope = RotaryEmbedding(D, 10000.0, None, 4096, REF)
    cos_sin = build_cos_sin_cache(rope.inv_freq, 4096)
    qkv = torch.randn(T, (Hq + 2 * Hk) * D)
    positions = torch.randint(0, 4096, (T,))
    loc = torch.randperm(S - 1)[:T] + 1

    def run(fused):
        buf = qkv.clone()
        q, k, v = (t.view(T, -1, D) for t in buf.split([Hq * D, Hk * D, Hk * D], dim=-1))
        caches = (
            torch.zeros(S, Hk, D, dtype=cache_dtype),
            torch.zeros(S, Hk, D, dtype=cache_dtype),
        )
        if fused:
            rotary_and_store(q, k, v, positions, cos_sin, *caches, loc)
        else:
            rotary_inplace(q, k, positions, cos_sin)
            store_kv(k, v, *caches, loc)
        return buf, caches

    buf_f, (kc_f, vc_f) = run(True)
    buf_u, (kc_u, vc_u) = run(False)
    assert torch.equal(buf_f, buf_u)  # q and k rotated in place, v untouched
    assert torch.equal(kc_f.float(), kc_u.float()) and torch.equal(vc_f.float(), vc_u.float())
    assert kc_f[loc].float().abs().sum() > 0 and (kc_f[0] == 0).all()  # only slots in loc


def test_rotary_bf16():
    torch.manual_seed(4)
    T, Hq, Hk, D = 37, 4, 2, 64
    rope = RotaryEmbedding(D, 10000.0, None, 4096, REF)
    cache = build_cos_sin_cache(rope.inv_freq, 1024)
    q = torch.randn(T, Hq, D).to(torch.bfloat16)
    k = torch.randn(T, Hk, D).to(torch.bfloat16)
    positions = torch.randint(0, 1024, (T,), dtype=torch.int32)
    want_q, want_k = rope(positions, q, k)
    rotary_inplace(q, k, positions, cache)
    assert_bf16_close(q, want_q)
    assert_bf16_close(k, want_k)


@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("inter", [64, 1000])
def test_silu_and_mul_matches_torch(T, inter):
    torch.manual_seed(T + inter)
    x = torch.randn(T, 2 * inter) * 4
    out = silu_and_mul(x)
    assert out.shape == (T, inter)
    torch.testing.assert_close(out, ref_act.silu_and_mul(x, TORCH_REFERENCE), **TOL)


def test_silu_and_mul_strided_rows_and_bf16():
    torch.manual_seed(5)
    big = (torch.randn(37, 2 * 300 + 50) * 4).to(torch.bfloat16)
    x = big[:, : 2 * 300]  # row stride 650, not 600
    assert_bf16_close(silu_and_mul(x), ref_act.silu_and_mul(x, TORCH_REFERENCE))


@pytest.mark.parametrize("D", [64, 128])
def test_store_kv_scatter_with_duplicate_dummy_slot(D):
    torch.manual_seed(D)
    T, KVH, Hq, S, dummy = 37, 2, 4, 128, 0
    qkv = torch.randn(T, (Hq + 2 * KVH) * D)
    _, k, v = qkv.split([Hq * D, KVH * D, KVH * D], dim=-1)
    k, v = k.view(T, KVH, D), v.view(T, KVH, D)
    pad = [3, 17, 36]  # padded rows, all aimed at the dummy slot
    real = [t for t in range(T) if t not in pad]
    loc = torch.full((T,), dummy, dtype=torch.int64)
    loc[real] = torch.randperm(S - 1)[: len(real)] + 1
    sentinel = -7.0
    k_cache = torch.full((S, KVH, D), sentinel)
    v_cache = torch.full((S, KVH, D), sentinel)
    store_kv(k, v, k_cache, v_cache, loc)
    assert torch.equal(k_cache[loc[real]], k[real]) and torch.equal(v_cache[loc[real]], v[real])
    untouched = torch.ones(S, dtype=torch.bool)
    untouched[loc] = False
    assert (k_cache[untouched] == sentinel).all() and (v_cache[untouched] == sentinel).all()
    for cache, src in ((k_cache, k), (v_cache, v)):
        hits = (cache[dummy][None] == src[pad]).any(dim=0)  # each element from some pad row
        assert hits.all()


def test_store_kv_casts_to_cache_dtype():
    torch.manual_seed(6)
    T, KVH, D, S = 5, 2, 64, 16
    # float32 values that bf16 holds exactly (see the NOTE on interpreter rounding)
    k = torch.randn(T, KVH, D).to(torch.bfloat16).float()
    v = torch.randn(T, KVH, D).to(torch.bfloat16).float()
    k_cache = torch.zeros(S, KVH, D, dtype=torch.bfloat16)
    v_cache = torch.zeros(S, KVH, D, dtype=torch.bfloat16)
    loc = torch.tensor([9, 2, 15, 4, 7])
    store_kv(k, v, k_cache, v_cache, loc)
    assert torch.equal(k_cache[loc], k.to(torch.bfloat16))
    assert torch.equal(v_cache[loc], v.to(torch.bfloat16))


def test_store_kv_saturates_into_an_fp8_cache():
    from gyrfalcon.forward.kv_cache import FP8_MAX, KVCache

    fp8 = torch.float8_e4m3fn
    T, KVH, D, S = 4, 2, 64, 16
    # values e4m3 holds exactly (the interpreter's fp8 rounding differs from the GPU's),
    # plus out-of-range ones that must saturate, not become NaN
    k = torch.randn(T, KVH, D).to(fp8).float()
    v = torch.randn(T, KVH, D).to(fp8).float()
    k[0, 0, :4] = torch.tensor([1e4, -1e4, 449.0, -600.0])
    v[1, 1, :2] = torch.tensor([3e38, -500.0])
    loc = torch.tensor([9, 2, 15, 4])
    fused = (torch.zeros(S, KVH, D, dtype=fp8), torch.zeros(S, KVH, D, dtype=fp8))
    store_kv(k, v, *fused, loc)
    ref = KVCache(1, S, 1, KVH, D, fp8, torch.device("cpu"))
    ref.write(0, loc, k, v)  # the torch path (CPU tensors never take the kernel)
    for got, want, src in ((fused[0], ref.k[0], k), (fused[1], ref.v[0], v)):
        assert got.dtype == fp8
        assert torch.equal(got[loc].float(), want[loc].float())
        assert torch.equal(got[loc].float(), src.clamp(-FP8_MAX, FP8_MAX))
