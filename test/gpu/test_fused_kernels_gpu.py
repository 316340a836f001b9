"""Triton fused kernels on CUDA at realistic sizes, against the torch layers on CUDA.

Run on the GPU machine: `python -m pytest test/gpu -m gpu -q`.
"""

import importlib.util
import os
from types import SimpleNamespace

import pytest
import torch

from gyrfalcon.kernels.dispatch import TORCH_REFERENCE
from gyrfalcon.layers import activation as ref_act
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.layers.norm import RMSNorm
from gyrfalcon.layers.rotary import RotaryEmbedding

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float32]
# float32: summation order / approximate rsqrt+exp / fma contraction cost a few ulps.
# bf16: every intermediate is rounded like torch's, so an approximate rsqrt/exp can
# flip at most a rounding or two (a bf16 ulp is 2**-8..2**-7 relative).
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=2**-6)}
# The layers below are the references: built to run their torch code on CUDA too.
REF = LayerContext(kernels=TORCH_REFERENCE)


@pytest.fixture(scope="module")
def kern():
    """The kernel modules, compiled for the GPU.

    NOTE: the CPU unit tests set TRITON_INTERPRET=1 at import and triton decides
    interpreter-vs-compiler when a kernel module is imported (and consults the flag
    while compiling), so fresh module objects are built and used with it unset.
    """
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("triton")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        # NOTE: pdl's gate is a jit function the kernel modules import: compiled first
        pdl = importlib.import_module("gyrfalcon.kernels.pdl")
        if type(pdl.pdl_gate).__name__ == "InterpretedFunction":
            importlib.reload(pdl)
        mods = {}
        for name in (
            "norm",
            "rotary",
            "activation",
            "kv_store",
            "argmax",
            "soft_cross_entropy",
            "train_layers",
        ):
            spec = importlib.util.find_spec(f"gyrfalcon.kernels.{name}")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            mods[name] = mod
        assert "TRITON_INTERPRET" not in os.environ
        yield SimpleNamespace(**mods)


def ref_norm(hidden, dtype, eps=1e-5):
    norm = RMSNorm(hidden, eps, REF)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden) * 0.5 + 1.0)
    return norm.to(device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 300, 8192])
@pytest.mark.parametrize("H,block", [(576, None), (4096, None), (4096, 1024)])
def test_rmsnorm(kern, dtype, T, H, block):
    torch.manual_seed(0)
    norm = ref_norm(H, dtype)
    x = (torch.randn(T, H, device="cuda") * 3).to(dtype)
    out = kern.norm.rmsnorm(x, norm.weight.data, norm.eps, block_size=block)
    torch.testing.assert_close(out, norm(x), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_per_head_qk_norm(kern, dtype):
    torch.manual_seed(1)
    T, Hq, Hk, D = 4096, 32, 8, 128
    norm = ref_norm(D, dtype)
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, device="cuda").to(dtype)
    k = qkv[:, Hq * D : (Hq + Hk) * D].view(T, Hk, D)
    torch.testing.assert_close(
        kern.norm.rmsnorm(k, norm.weight.data, norm.eps), norm(k), **TOL[dtype]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 8192])
@pytest.mark.parametrize("block", [None, 1024])
def test_fused_add_rmsnorm(kern, dtype, T, block):
    torch.manual_seed(2)
    H = 4096
    norm = ref_norm(H, dtype)
    x = torch.randn(T, H, device="cuda").to(dtype)
    res = (torch.randn(T, H, device="cuda") * 4).to(dtype)
    want_res = res + x
    want = norm(want_res)
    normed, new_res = kern.norm.fused_add_rmsnorm(
        x, res, norm.weight.data, norm.eps, block_size=block
    )
    assert normed.data_ptr() == x.data_ptr() and new_res.data_ptr() == res.data_ptr()
    assert torch.equal(new_res, want_res)  # one rounded add, exactly torch's
    torch.testing.assert_close(normed, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 8192])
@pytest.mark.parametrize("Hq,Hk,D", [(32, 8, 128), (9, 3, 64)])
def test_rotary_on_split_qkv(kern, dtype, T, Hq, Hk, D):
    torch.manual_seed(3)
    max_pos = 32768
    rope = RotaryEmbedding(D, 500000.0, None, 32768, REF).cuda()
    cache = kern.rotary.build_cos_sin_cache(rope.inv_freq, max_pos)
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, device="cuda").to(dtype)
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    q, k, v = q.view(T, Hq, D), k.view(T, Hk, D), v.view(T, Hk, D)
    positions = torch.randint(0, max_pos, (T,), device="cuda")
    want_q, want_k = rope(positions, q.clone(), k.clone())
    v0 = v.clone()
    kern.rotary.rotary_inplace(q, k, positions, cache)
    torch.testing.assert_close(q, want_q, **TOL[dtype])
    torch.testing.assert_close(k, want_k, **TOL[dtype])
    assert torch.equal(v, v0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("Hq,Hk,D", [(32, 8, 128), (9, 3, 64)])
def test_rotary_rounds_as_torch_does(kern, dtype, Hq, Hk, D):
    """Bit for bit the torch layer's: each product and the sum rounded to the dtype,
    none fused into an FMA (kernels/rotary.py), subnormals kept (every 5th token's
    values at the dtype's smallest normal)."""
    torch.manual_seed(13)
    T, max_pos = 4096, 32768
    rope = RotaryEmbedding(D, 500000.0, None, max_pos, REF).cuda()
    cache = kern.rotary.build_cos_sin_cache(rope.inv_freq, max_pos)
    x = torch.randn(T, Hq + Hk, D, device="cuda") * 4
    x[::5] *= torch.finfo(dtype).tiny
    q, k = x.to(dtype).split([Hq, Hk], dim=1)
    positions = torch.randint(0, max_pos, (T,), device="cuda")
    want_q, want_k = rope(positions, q.clone(), k.clone())
    kern.rotary.rotary_inplace(q, k, positions, cache)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 8192])
@pytest.mark.parametrize("inter", [1536, 14336])
def test_silu_and_mul(kern, dtype, T, inter):
    torch.manual_seed(4)
    x = (torch.randn(T, 2 * inter, device="cuda") * 4).to(dtype)
    out = kern.activation.silu_and_mul(x)
    torch.testing.assert_close(out, ref_act.silu_and_mul(x, TORCH_REFERENCE), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 8192])
def test_store_kv_matches_index_copy(kern, dtype, T):
    torch.manual_seed(5)
    Hq, KVH, D, S = 32, 8, 128, 65536
    qkv = torch.randn(T, (Hq + 2 * KVH) * D, device="cuda", dtype=torch.float32)
    _, k, v = qkv.split([Hq * D, KVH * D, KVH * D], dim=-1)
    k, v = k.view(T, KVH, D), v.view(T, KVH, D)
    loc = torch.randperm(S - 16, device="cuda")[:T] + 16  # page 0 (16 slots) is the dummy
    pad = torch.arange(T, device="cuda") % 7 == 3
    loc[pad] = 0
    k_cache = torch.zeros(S, KVH, D, device="cuda", dtype=dtype)
    v_cache = torch.zeros(S, KVH, D, device="cuda", dtype=dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    real = ~pad
    want_k.index_copy_(0, loc[real], k[real].to(dtype))
    want_v.index_copy_(0, loc[real], v[real].to(dtype))
    kern.kv_store.store_kv(k, v, k_cache, v_cache, loc)
    # exact, including float32 -> bf16 rounding; slot 0 is only written by padded rows
    assert torch.equal(k_cache[1:], want_k[1:]) and torch.equal(v_cache[1:], want_v[1:])
    if pad.any():
        hits = (k_cache[0][None] == k[pad].to(dtype)).any(dim=0)
        assert hits.all()


def test_kernels_capture_in_cuda_graph(kern):
    # no host syncs: the whole sequence must be capturable and replayable
    torch.manual_seed(6)
    T, H, Hq, Hk, D, inter, dt = 64, 4096, 32, 8, 128, 14336, torch.bfloat16
    norm = ref_norm(H, dt)
    rope = RotaryEmbedding(D, 10000.0, None, 4096, REF).cuda()
    cache = kern.rotary.build_cos_sin_cache(rope.inv_freq, 4096)
    x = torch.randn(T, H, device="cuda").to(dt)
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, device="cuda").to(dt)
    gu = torch.randn(T, 2 * inter, device="cuda").to(dt)
    positions = torch.randint(0, 4096, (T,), device="cuda")
    loc = torch.randperm(1024, device="cuda")[:T]
    kc = torch.zeros(1024, Hk, D, device="cuda", dtype=dt)
    vc = torch.zeros_like(kc)
    q, k, v = qkv.split([Hq * D, Hk * D, Hk * D], dim=-1)
    q, k, v = q.view(T, Hq, D), k.view(T, Hk, D), v.view(T, Hk, D)
    want_q, want_k = rope(positions, q.clone(), k.clone())

    def step():
        n = kern.norm.rmsnorm(x, norm.weight.data, norm.eps)
        kern.rotary.rotary_inplace(q, k, positions, cache)
        kern.kv_store.store_kv(k, v, kc, vc, loc)
        return n, kern.activation.silu_and_mul(gu)

    qkv0 = qkv.clone()
    step()  # compile outside the capture
    torch.cuda.synchronize()
    qkv.copy_(qkv0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        n, act = step()
    qkv.copy_(qkv0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(n, norm(x), **TOL[dt])
    torch.testing.assert_close(act, ref_act.silu_and_mul(gu, TORCH_REFERENCE), **TOL[dt])
    torch.testing.assert_close(q, want_q, **TOL[dt])
    assert torch.equal(kc[loc], k)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("T", [1, 8192])
def test_rotary_and_store_equals_rotary_then_store(kern, cache_dtype, T):
    torch.manual_seed(7)
    Hq, Hk, D, S = 32, 8, 128, 65536
    rope = RotaryEmbedding(D, 500000.0, None, 4096, REF).cuda()
    cos_sin = kern.rotary.build_cos_sin_cache(rope.inv_freq, 4096)
    qkv = (torch.randn(T, (Hq + 2 * Hk) * D, device="cuda") * 100).to(torch.bfloat16)
    qkv[:, -1] = -1000.0  # the last v element of every token: past e4m3's range
    positions = torch.randint(0, 4096, (T,), device="cuda")
    loc = torch.randperm(S - 16, device="cuda")[:T] + 16

    def run(fused):
        buf = qkv.clone()
        q, k, v = (t.view(T, -1, D) for t in buf.split([Hq * D, Hk * D, Hk * D], dim=-1))
        kc = torch.zeros(S, Hk, D, device="cuda", dtype=cache_dtype)
        vc = torch.zeros_like(kc)
        if fused:
            kern.rotary.rotary_and_store(q, k, v, positions, cos_sin, kc, vc, loc)
        else:
            kern.rotary.rotary_inplace(q, k, positions, cos_sin)
            kern.kv_store.store_kv(k, v, kc, vc, loc)
        return buf, kc, vc

    got, want = run(True), run(False)
    assert torch.equal(got[0], want[0])
    # NOTE: x100 puts some values past e4m3's 448: they must saturate, never be NaN
    for g, w in zip(got[1:], want[1:]):
        assert torch.equal(g.float(), w.float()) and not g.float().isnan().any()
    if cache_dtype == torch.float8_e4m3fn:
        assert (got[2][loc, -1, -1].float() == -448.0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bs", [1, 3, 256])
def test_argmax_rows_equals_torch(kern, dtype, bs):
    """Greedy sampling's argmax over a Llama-3 vocabulary, with ties placed across
    chunks (the smallest index wins) and a NaN row (NaN wins), as torch.argmax."""
    vocab = 128256
    x = torch.randn(bs, vocab, device="cuda").to(dtype)
    x[0, [77_000, 5_000, 100_000]] = 50.0
    if bs > 1:
        x[1, [4097, 128255]] = float("nan")
    assert torch.equal(kern.argmax.argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_soft_cross_entropy_matches_torch(kern, dtype):
    """The drafter trainer's loss at its scale (16k draft vocabulary, thousands of rows):
    the fused kernels' loss, gradient and argmax against torch's softmax formula."""
    torch.manual_seed(0)
    n, vocab = 3000, 16384
    x = (torch.randn(n, vocab, device="cuda") * 4).to(dtype).requires_grad_()
    targets = (torch.randn(n + 100, vocab, device="cuda") * 3).to(dtype)
    rows = torch.randint(0, n + 100, (n,), device="cuda")
    w = torch.rand(n, device="cuda")
    ce, argmax = kern.soft_cross_entropy.soft_cross_entropy_triton(x, targets, rows)
    (ce * w).sum().backward()
    grad, x.grad = x.grad, None
    p = torch.softmax(targets[rows].float(), dim=-1)
    want = -(p * torch.log_softmax(x.float(), dim=-1)).sum(-1)
    (want * w).sum().backward()
    torch.testing.assert_close(ce, want, atol=1e-4, rtol=1e-5)
    assert torch.equal(argmax, x.detach().argmax(-1))
    assert grad.dtype == dtype
    tol = dict(atol=1e-7, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-7, rtol=2**-7)
    torch.testing.assert_close(grad.float(), x.grad.float(), **tol)


# The drafter trainer's fused layers (kernels/train_layers.py) at its scale: N = B * S rows
TRAIN_ROWS, TRAIN_SEQ = 30000, 1000
# bf16: one rounding of the float32 result (half a bf16 ulp, 2**-9..2**-8 relative)
TRAIN_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-5, rtol=2**-7)}


def train_grads(fn, inputs, needs):
    """fn's outputs and the gradients (for inputs flagged in needs) of a random weighted
    sum of them, the weights bf16 numbers: exact as a bf16 or a float32 output's grad."""
    inputs = [
        x.detach().clone().requires_grad_(need) if torch.is_tensor(x) else x
        for x, need in zip(inputs, needs)
    ]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator(device="cuda").manual_seed(0)
    loss = 0.0
    for out in outs:
        w = torch.randn(out.shape, device="cuda", generator=gen).to(torch.bfloat16).float()
        loss = loss + (out.float() * w).sum()
    loss.backward()
    return [o.detach() for o in outs], [x.grad for x, need in zip(inputs, needs) if need]


def check_train(got, want, dtype, **grad_tol):
    """Triton's (from `dtype` inputs) against the reference's (on float32 copies)."""
    for out, w in zip(got[0], want[0]):
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), w, **TRAIN_TOL[dtype])
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g.float(), w, **(grad_tol or TRAIN_TOL[g.dtype]))


def f32(xs):
    return [x.float() if torch.is_tensor(x) else x for x in xs]


@pytest.mark.parametrize("dtype", DTYPES)
def test_train_rms_norm_matches_torch(kern, dtype):
    torch.manual_seed(8)
    x = (torch.randn(TRAIN_ROWS // TRAIN_SEQ, TRAIN_SEQ, 576, device="cuda") * 3).to(dtype)
    w = torch.randn(576, device="cuda") * 0.5 + 1.0
    mod = kern.train_layers
    args, needs = [x, w, 1e-5], [True, True, False]
    got = train_grads(mod.rms_norm_triton, args, needs)
    want = train_grads(mod.rms_norm_ref, f32(args), needs)
    check_train((got[0], got[1][:1]), (want[0], want[1][:1]), dtype)
    # dweight: a float32 sum over all rows (summation order differs)
    torch.testing.assert_close(got[1][1], want[1][1], atol=1e-3, rtol=1e-5)
    only_dw = train_grads(mod.rms_norm_triton, args, [False, True, False])
    assert torch.equal(only_dw[1][0], got[1][1])  # deterministic, with or without dx


@pytest.mark.parametrize("dtype", DTYPES)
def test_train_rotate_qkv_matches_torch(kern, dtype):
    torch.manual_seed(9)
    q_size, kv_size, head_dim = 576, 192, 64
    qkv = torch.randn(TRAIN_ROWS, q_size + 2 * kv_size, device="cuda").to(dtype)
    rope = RotaryEmbedding(head_dim, 10000.0, None, 4096, REF).cuda()
    freqs = (torch.arange(TRAIN_SEQ, device="cuda") + 2).float()[:, None] * rope.inv_freq
    args = [qkv, freqs.cos(), freqs.sin(), q_size, kv_size, head_dim]
    needs = [True] + [False] * 5
    mod = kern.train_layers
    check_train(
        train_grads(mod.rotate_qkv_triton, args, needs),
        train_grads(mod.rotate_qkv_ref, f32(args), needs),
        dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_train_silu_mul_matches_torch(kern, dtype):
    torch.manual_seed(10)
    gate_up = (torch.randn(TRAIN_ROWS, 2 * 1536, device="cuda") * 4).to(dtype)
    mod = kern.train_layers
    check_train(
        train_grads(mod.silu_mul_triton, [gate_up], [True]),
        train_grads(mod.silu_mul_ref, f32([gate_up]), [True]),
        dtype,
    )
