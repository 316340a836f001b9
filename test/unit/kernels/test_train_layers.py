"""The drafter trainer's fused layers (RMSNorm, RoPE on a fused qkv, SiLU-and-multiply):
the Triton kernels (CPU interpreter) against the torch references, value and every
gradient, and both against the engine layers' torch math (train/ttt.py's torch ops)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: must precede every triton import

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402

from gyrfalcon.kernels.dispatch import TORCH_REFERENCE  # noqa: E402
from gyrfalcon.kernels.train_layers import (  # noqa: E402
    rms_norm,
    rms_norm_ref,
    rms_norm_triton,
    rotate_qkv,
    rotate_qkv_ref,
    rotate_qkv_triton,
    silu_mul,
    silu_mul_ref,
    silu_mul_triton,
)
from gyrfalcon.layers.context import LayerContext  # noqa: E402
from gyrfalcon.layers.norm import RMSNorm  # noqa: E402
from gyrfalcon.layers.rotary import RotaryEmbedding  # noqa: E402

F32 = dict(atol=1e-5, rtol=1e-5)
# NOTE: triton's interpreter truncates float32 -> bfloat16 where torch rounds to nearest
# even: one rounding apart is up to a bf16 ulp (2**-7 relative); allow two
BF16 = dict(atol=1e-5, rtol=2**-6)
DTYPES = [torch.float32, torch.bfloat16]
REF = LayerContext(kernels=TORCH_REFERENCE)  # the layers' torch code


def grads_of(fn, inputs, needs, seed=0, use=None):
    """fn(*inputs) and the gradients of a random weighted sum of its outputs (those
    picked by `use`) for the inputs flagged in `needs` (None for the others). The
    weights are bf16 numbers, so every dtype's output gradient holds them exactly."""
    inputs = [
        x.detach().clone().requires_grad_(need) if isinstance(x, torch.Tensor) else x
        for x, need in zip(inputs, needs)
    ]
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(seed)
    loss = 0.0
    for i, out in enumerate(outs):
        w = torch.randn(out.shape, generator=gen).to(torch.bfloat16).float()
        if use is None or i in use:
            loss = loss + (out.float() * w).sum()
    loss.backward()  # NOTE: every case needs some gradient
    grads = [x.grad if need else None for x, need in zip(inputs, needs)]
    return [o.detach() for o in outs], grads


def assert_matches(got, want, dtype):
    """got (from `dtype` inputs) against want (the reference on float32 copies)."""
    (outs, grads), (want_outs, want_grads) = got, want
    for out, w in zip(outs, want_outs):
        assert out.dtype == dtype and out.is_contiguous() and out.shape == w.shape
        torch.testing.assert_close(out.float(), w, **(F32 if dtype == torch.float32 else BF16))
    for g, w in zip(grads, want_grads):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g.float(), w, **(F32 if g.dtype == torch.float32 else BF16))


def f32(xs):
    return [x.float() if torch.is_tensor(x) else x for x in xs]


def rms_case(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3 + 0.5).to(dtype)
    weight = torch.randn(shape[-1], generator=gen) * 0.5 + 1.0
    return x, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [40, 576])
@pytest.mark.parametrize("n", [1, 5, 37, 300])  # 300: three backward programs' partials
def test_rms_norm_value_and_gradients(dtype, hidden, n):
    x, weight = rms_case((n, hidden), dtype, seed=n + hidden)
    got = grads_of(rms_norm_triton, [x, weight, 1e-5], [True, True, False], seed=n)
    want = grads_of(rms_norm_ref, f32([x, weight, 1e-5]), [True, True, False], seed=n)
    assert_matches(got, want, dtype)
    assert got[1][0].dtype == dtype and got[1][1].dtype == torch.float32
    assert got[1][1].abs().min() > 0  # every column's dweight is a real sum


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_gradient_subsets_and_strided_3d_input(dtype):
    """x [B, S, H] read through a column slice (strided rows); an embedding's output
    (no gradient: only dweight) and a frozen weight (only dx)."""
    gen = torch.Generator().manual_seed(7)
    big = (torch.randn(3, 13, 50, generator=gen) * 2).to(dtype)
    x, weight = big[..., :40], torch.rand(40, generator=gen) + 0.5
    assert not x.is_contiguous()
    for needs in ([True, True, False], [False, True, False], [True, False, False]):
        got = grads_of(rms_norm_triton, [x, weight, 1e-6], needs, seed=1)
        want = grads_of(rms_norm_ref, f32([x, weight, 1e-6]), needs, seed=1)
        assert got[0][0].shape == x.shape
        assert_matches(got, want, dtype)


def rope_tables(pos: int, half: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    angle = torch.rand(pos, half, generator=gen) * 20 - 10
    return angle.cos(), angle.sin()


ROPE_CASES = [  # rows, table rows P, q heads, kv heads, head_dim
    (1, 1, 9, 3, 8),
    (5, 3, 9, 3, 8),  # P < N: row r takes table row r % P
    (37, 37, 9, 3, 64),
    (37, 10, 9, 3, 64),
    (5, 5, 2, 1, 6),  # a half of 3 columns
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,pos,hq,hk,d", ROPE_CASES)
def test_rotate_qkv_value_and_gradient(dtype, n, pos, hq, hk, d):
    gen = torch.Generator().manual_seed(n * pos + d)
    qkv = (torch.randn(n, (hq + 2 * hk) * d, generator=gen) * 2).to(dtype)
    cos, sin = rope_tables(pos, d // 2, seed=d)
    args = [qkv, cos, sin, hq * d, hk * d, d]
    needs = [True] + [False] * 5
    got = grads_of(rotate_qkv_triton, args, needs, seed=n)
    want = grads_of(rotate_qkv_ref, f32(args), needs, seed=n)
    assert_matches(got, want, dtype)
    assert torch.equal(got[0][2], qkv[:, (hq + hk) * d :])  # v: a plain copy
    assert not torch.equal(got[0][0], qkv[:, : hq * d])  # q did turn


@pytest.mark.parametrize("use", [(0, 1), (2,), (1,)])
def test_rotate_qkv_gradient_of_unused_outputs_is_zero(use):
    """An output the loss never reads gets a None gradient: its columns of d_qkv are 0."""
    n, hq, hk, d = 7, 9, 3, 8
    qkv = torch.randn(n, (hq + 2 * hk) * d, generator=torch.Generator().manual_seed(3))
    cos, sin = rope_tables(4, d // 2, seed=4)
    args, needs = [qkv, cos, sin, hq * d, hk * d, d], [True] + [False] * 5
    got = grads_of(rotate_qkv_triton, args, needs, seed=2, use=use)
    want = grads_of(rotate_qkv_ref, args, needs, seed=2, use=use)
    assert_matches(got, want, torch.float32)
    bounds = [0, hq * d, (hq + hk) * d, (hq + 2 * hk) * d]
    for i in range(3):
        cols = got[1][0][:, bounds[i] : bounds[i + 1]]
        assert (cols.abs().sum() > 0) == (i in use)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,inter", [(1, 7), (37, 7), (5, 1536)])
def test_silu_mul_value_and_gradient(dtype, n, inter):
    gen = torch.Generator().manual_seed(n + inter)
    gate_up = (torch.randn(n, 2 * inter, generator=gen) * 4).to(dtype)
    got = grads_of(silu_mul_triton, [gate_up], [True], seed=n)
    want = grads_of(silu_mul_ref, f32([gate_up]), [True], seed=n)
    assert_matches(got, want, dtype)
    assert got[1][0].shape == gate_up.shape and got[1][0].dtype == dtype


def test_empty_batch():
    x, weight = rms_case((0, 40), torch.float32, seed=0)
    (y,), (dx, dw, _) = grads_of(rms_norm_triton, [x, weight, 1e-5], [True, True, False])
    assert y.shape == (0, 40) and dx.shape == (0, 40) and torch.equal(dw, torch.zeros(40))
    qkv = torch.randn(0, 15 * 8)
    cos, sin = rope_tables(3, 4, seed=0)
    outs, (dqkv, *_) = grads_of(rotate_qkv_triton, [qkv, cos, sin, 72, 24, 8], [True] + [False] * 5)
    assert [o.shape for o in outs] == [(0, 72), (0, 24), (0, 24)] and dqkv.shape == (0, 120)
    (y,), (dgu,) = grads_of(silu_mul_triton, [torch.randn(0, 14)], [True])
    assert y.shape == (0, 7) and dgu.shape == (0, 14)


def test_cpu_tensors_take_the_references():
    x, weight = rms_case((2, 5, 40), torch.bfloat16, seed=1)
    assert torch.equal(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5))
    qkv = torch.randn(6, 15 * 8)
    cos, sin = rope_tables(3, 4, seed=1)
    got, want = rotate_qkv(qkv, cos, sin, 72, 24, 8), rotate_qkv_ref(qkv, cos, sin, 72, 24, 8)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    gate_up = torch.randn(4, 22).to(torch.bfloat16)
    assert torch.equal(silu_mul(gate_up), silu_mul_ref(gate_up))


def test_references_equal_the_engine_layers():
    """The math train/ttt.py had as torch ops, and still must equal: rotate_qkv on a
    [B, S] batch flattened to rows, with the [S, D/2] tables of one unroll step's
    positions, is `RotaryEmbedding.forward` (rotate-half) on q and k; rms_norm is
    `RMSNorm.forward` in float32 (both the layers' torch code)."""
    b, s, hq, hk, d, step = 2, 6, 9, 3, 64, 2
    gen = torch.Generator().manual_seed(11)
    rope = RotaryEmbedding(d, 10000.0, None, 64, REF)
    positions = torch.arange(s) + step
    freqs = positions.float()[:, None] * rope.inv_freq[None, :]  # [S, D/2]
    cos, sin = freqs.cos(), freqs.sin()
    qkv = torch.randn(b * s, (hq + 2 * hk) * d, generator=gen)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    want_q, want_k = rope(positions.repeat(b), q.reshape(-1, hq, d), k.reshape(-1, hk, d))
    for fn in (rotate_qkv_ref, rotate_qkv_triton):
        got_q, got_k, got_v = fn(qkv, cos, sin, hq * d, hk * d, d)
        torch.testing.assert_close(got_q, want_q.reshape(b * s, -1), **F32)
        torch.testing.assert_close(got_k, want_k.reshape(b * s, -1), **F32)
        assert torch.equal(got_v, v)
    norm = RMSNorm(40, 1e-5, REF)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(40, generator=gen) * 0.5 + 1.0)
    x = torch.randn(b, s, 40, generator=gen) * 3
    want = norm(x)
    torch.testing.assert_close(rms_norm_ref(x, norm.weight, norm.eps), want, **F32)
    torch.testing.assert_close(rms_norm_triton(x, norm.weight, norm.eps), want, **F32)
