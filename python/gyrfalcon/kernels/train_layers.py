"""The elementwise parts of the drafter's training step (train/ttt.py's `draft_step`),
fused: one kernel forward and one backward for each, where torch's composites ran 6-12
kernels each way, each moving a float32 copy of its [N, width] operand through memory.

RMSNorm, x [N, H], weight w [H], float32 math, one rounding to x's dtype:

    rstd = 1 / sqrt(mean_h x^2 + eps)      n = x * rstd      y = w * n
    dx = rstd * (g - n * mean_h(g * n))    with g = dy * w
    dw = sum over rows of dy * n

The forward saves rstd [N] for the backward. The backward's programs each handle a
block of rows and write their partial dw [H] (a float32 row each), summed by torch:
deterministic, no atomics.

RoPE in rotate-half layout on the q and k heads of a fused qkv [N, q | k | v] (heads
of D consecutive columns, halves x1, x2 of D/2), row r taking cos, sin [D/2] from row
r % P of the [P, D/2] tables:

    out1 = x1 c - x2 s      out2 = x2 c + x1 s      (v passes through)
    dx1 = g1 c + g2 s       dx2 = g2 c - g1 s       (the transpose: s negated)

so one kernel, rotating a column range of a source into a column range of a
destination with the sign of s a flag (0: a plain copy, v's), serves both directions.

SiLU-and-multiply on a fused [N, gate | up] (each I wide), sg = sigmoid(gate):

    y = gate * sg * up
    d_gate = dy * up * sg * (1 + gate * (1 - sg))      d_up = dy * gate * sg

`rms_norm`, `rotate_qkv` and `silu_mul` take the kernels on CUDA and the same math in
torch elsewhere (the `*_ref` functions, which autograd differentiates).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

# NOTE: sizes measured best on an H100 at the trainer's scale (N = 30000, H = 576, bf16)
TILE = 4096  # elements of a row tile: its rows = TILE // the row's block
BWD_TILE = 8192  # the RMSNorm backward's
DW_ROWS = 128  # rows behind one partial dweight row of the RMSNorm backward
SILU_BLOCK = 1024  # columns of I a program reads at once


def _tile_rows(block: int, tile: int = TILE) -> int:
    return max(1, min(16, tile // block))


@triton.jit
def _rms_fwd_kernel(
    x_ptr,  # [N, H] contiguous
    w_ptr,  # [H]
    y_ptr,  # [N, H] out, x's dtype
    rstd_ptr,  # [N] float32 out
    n_rows,
    hidden,
    eps,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    rmask, cmask = rows < n_rows, cols < hidden
    mask = rmask[:, None] & cmask[None, :]
    offs = rows[:, None] * hidden + cols[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 1) / hidden + eps)
    y = w[None, :] * (x * rstd[:, None])
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=rmask)


@triton.jit
def _rms_bwd_kernel(
    dy_ptr,  # [N, H] contiguous, x's dtype
    x_ptr,  # [N, H] contiguous
    w_ptr,  # [H]
    rstd_ptr,  # [N] float32
    dx_ptr,  # [N, H] out, x's dtype (written when HAS_DX)
    dw_ptr,  # [programs, H] float32 out: partial dw (written when HAS_DW)
    n_rows,
    hidden,
    ROWS: tl.constexpr,  # rows of a tile
    TILES: tl.constexpr,  # tiles of a program
    BLOCK: tl.constexpr,
    HAS_DX: tl.constexpr,
    HAS_DW: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    cmask = cols < hidden
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros([ROWS, BLOCK], dtype=tl.float32)
    for t in range(TILES):
        rows = (pid * TILES + t) * ROWS + tl.arange(0, ROWS)
        rmask = rows < n_rows
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None] * hidden + cols[None, :]
        dy = tl.load(dy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=rmask, other=0.0)
        n = x * rstd[:, None]
        if HAS_DW:
            acc += dy * n
        if HAS_DX:
            g = dy * w[None, :]
            mean_gn = tl.sum(g * n, 1) / hidden
            dx = rstd[:, None] * (g - n * mean_gn[:, None])
            tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    if HAS_DW:
        tl.store(dw_ptr + pid * hidden + cols, tl.sum(acc, 0), mask=cmask)


@triton.jit
def _rotate_kernel(
    src_ptr,  # [N, *] rows of heads of 2 * HALF columns from column src_col
    dst_ptr,  # [N, *] out, the same heads from column dst_col
    cos_ptr,  # [P, HALF] float32 contiguous
    sin_ptr,
    n_rows,
    n_pos,  # P: row r uses table row r % P
    src_stride,
    dst_stride,
    src_col,
    dst_col,
    width,  # heads * HALF
    HALF: tl.constexpr,
    SIGN: tl.constexpr,  # 1.0 rotates by +angle (forward), -1.0 by -angle; 0.0 copies
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, BLOCK)
    i = j % HALF
    c1 = (j // HALF) * (2 * HALF) + i  # the column of x1 in its head; x2 is HALF on
    mask = (rows < n_rows)[:, None] & (j < width)[None, :]
    src = src_ptr + rows[:, None] * src_stride + src_col + c1[None, :]
    dst = dst_ptr + rows[:, None] * dst_stride + dst_col + c1[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    if SIGN != 0.0:
        tab = (rows % n_pos)[:, None] * HALF + i[None, :]
        c = tl.load(cos_ptr + tab, mask=mask, other=0.0)
        s = tl.load(sin_ptr + tab, mask=mask, other=0.0) * SIGN
        x1, x2 = x1 * c - x2 * s, x2 * c + x1 * s
    tl.store(dst, x1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, x2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(
    x_ptr,  # [N, 2I] contiguous: gate | up
    dy_ptr,  # [N, I] contiguous (read when BACKWARD)
    out_ptr,  # [N, I] out: y; or when BACKWARD [N, 2I]: d_gate | d_up, x's dtype
    inter,
    BACKWARD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
    sg = tl.sigmoid(gate)
    dt = out_ptr.dtype.element_ty
    if BACKWARD:
        dy = tl.load(dy_ptr + row * inter + cols, mask=mask, other=0.0).to(tl.float32)
        d_gate = dy * up * sg * (1.0 + gate * (1.0 - sg))
        tl.store(out_ptr + row * 2 * inter + cols, d_gate.to(dt), mask=mask)
        tl.store(out_ptr + row * 2 * inter + inter + cols, (dy * gate * sg).to(dt), mask=mask)
    else:
        tl.store(out_ptr + row * inter + cols, (gate * sg * up).to(dt), mask=mask)


def _check_rms(x: Tensor, weight: Tensor) -> None:
    shapes = (x.shape, weight.shape)
    assert weight.dim() == 1 and x.dim() >= 1 and x.shape[-1] == weight.shape[0] >= 1, shapes
    assert x.is_floating_point() and weight.is_floating_point(), (x.dtype, weight.dtype)


def _check_qkv(qkv: Tensor, cos: Tensor, sin: Tensor, q: int, kv: int, d: int):
    assert qkv.dim() == 2 and qkv.shape[1] == q + 2 * kv, (qkv.shape, q, kv)
    assert d >= 2 and d % 2 == 0 and q % d == 0 and kv % d == 0, (q, kv, d)
    assert cos.dim() == 2 and cos.shape == sin.shape and cos.shape[1] == d // 2, (cos.shape, d)
    assert cos.shape[0] >= 1 and cos.dtype == sin.dtype == torch.float32, (cos.shape, cos.dtype)
    assert cos.device == sin.device == qkv.device, (cos.device, sin.device, qkv.device)


def _check_silu(gate_up: Tensor) -> None:
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, gate_up.shape


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        _check_rms(x, weight)
        shape, hidden = x.shape, x.shape[-1]
        x2 = x.reshape(-1, hidden).contiguous()
        n = x2.shape[0]
        y = torch.empty_like(x2)
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)
        block = triton.next_power_of_2(hidden)
        rows = _tile_rows(block)
        if n:
            _rms_fwd_kernel[(triton.cdiv(n, rows),)](
                x2, weight, y, rstd, n, hidden, eps, ROWS=rows, BLOCK=block,
                num_warps=8 if block >= 1024 else 4,
            )  # fmt: skip
        ctx.save_for_backward(x2, weight, rstd)
        ctx.shape = shape
        return y.view(shape)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x2, weight, rstd = ctx.saved_tensors
        has_dx, has_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, hidden = x2.shape
        dy = dy.reshape(n, hidden).to(x2.dtype).contiguous()
        block = triton.next_power_of_2(hidden)
        rows = _tile_rows(block, BWD_TILE)
        tiles = max(1, DW_ROWS // rows)
        programs = triton.cdiv(n, rows * tiles)
        dx = torch.empty_like(x2) if has_dx else None
        partial = torch.empty(programs if has_dw else 0, hidden, device=x2.device)
        if n:
            _rms_bwd_kernel[(programs,)](
                dy, x2, weight, rstd, dx if has_dx else x2, partial if has_dw else rstd, n, hidden,
                ROWS=rows, TILES=tiles, BLOCK=block, HAS_DX=has_dx, HAS_DW=has_dw,
                num_warps=8 if block * x2.element_size() >= 4096 else 4,
            )  # fmt: skip
        dw = partial.sum(0).to(weight.dtype) if has_dw else None
        return (dx.view(ctx.shape) if has_dx else None), dw, None


def _rotate(src, dst, cos, sin, src_col, dst_col, heads, half, sign):
    n, width = src.shape[0], heads * half
    block = triton.next_power_of_2(width)
    rows = _tile_rows(2 * block)  # NOTE: each element of the block reads and writes two
    if n and width:
        _rotate_kernel[(triton.cdiv(n, rows),)](
            src, dst, cos, sin, n, cos.shape[0], src.stride(0), dst.stride(0), src_col,
            dst_col, width, HALF=half, SIGN=sign, ROWS=rows, BLOCK=block, num_warps=4,
        )  # fmt: skip


class _RotateQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, cos, sin, q_size: int, kv_size: int, head_dim: int):
        _check_qkv(qkv, cos, sin, q_size, kv_size, head_dim)
        qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
        n, half = qkv.shape[0], head_dim // 2
        q, k, v = qkv.new_empty(n, q_size), qkv.new_empty(n, kv_size), qkv.new_empty(n, kv_size)
        _rotate(qkv, q, cos, sin, 0, 0, q_size // head_dim, half, 1.0)
        _rotate(qkv, k, cos, sin, q_size, 0, kv_size // head_dim, half, 1.0)
        _rotate(qkv, v, cos, sin, q_size + kv_size, 0, kv_size // head_dim, half, 0.0)
        ctx.save_for_backward(cos, sin)
        ctx.set_materialize_grads(False)  # NOTE: an unused output's None gradient: zeros
        ctx.sizes = (q_size, kv_size, head_dim, qkv.dtype)
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        cos, sin = ctx.saved_tensors
        q_size, kv_size, head_dim, dtype = ctx.sizes
        n = (dq if dq is not None else dk if dk is not None else dv).shape[0]
        d_qkv = torch.empty(n, q_size + 2 * kv_size, dtype=dtype, device=cos.device)
        parts = ((dq, 0, q_size, -1.0), (dk, q_size, kv_size, -1.0))
        for g, col, size, sign in (*parts, (dv, q_size + kv_size, kv_size, 0.0)):
            if g is None:
                d_qkv[:, col : col + size].zero_()
            else:
                g = g.to(dtype).contiguous()
                _rotate(g, d_qkv, cos, sin, 0, col, size // head_dim, head_dim // 2, sign)
        return d_qkv, None, None, None, None, None


def _silu_mul(gate_up: Tensor, dy: Tensor | None, out: Tensor) -> Tensor:
    n, inter = gate_up.shape[0], gate_up.shape[1] // 2
    block = min(SILU_BLOCK, triton.next_power_of_2(max(inter, 1)))
    if n and inter:
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](
            gate_up, gate_up if dy is None else dy, out, inter, BACKWARD=dy is not None,
            BLOCK=block, num_warps=4,
        )  # fmt: skip
    return out


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: Tensor) -> Tensor:
        _check_silu(gate_up)
        gate_up = gate_up.contiguous()
        ctx.save_for_backward(gate_up)
        return _silu_mul(gate_up, None, gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2))

    @staticmethod
    def backward(ctx, dy: Tensor) -> Tensor:
        (gate_up,) = ctx.saved_tensors
        return _silu_mul(gate_up, dy.to(gate_up.dtype).contiguous(), torch.empty_like(gate_up))


def rms_norm_triton(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`rms_norm` through the kernels (CUDA, or the Triton interpreter)."""
    return _RMSNorm.apply(x, weight, eps)


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`rms_norm` in torch ops (autograd differentiates it)."""
    _check_rms(x, weight)
    x32 = x.float()
    return (weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x [..., H] (any float dtype), weight [H] (float32) -> weight * x / rms(x) in x's
    dtype: float32 statistics and products, one rounding. Gradients for x and weight
    (those that need them). The kernels on CUDA, torch elsewhere."""
    if x.is_cuda:
        return rms_norm_triton(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def rotate_qkv_triton(
    qkv: Tensor, cos: Tensor, sin: Tensor, q_size: int, kv_size: int, head_dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    """`rotate_qkv` through the kernels (CUDA, or the Triton interpreter)."""
    return _RotateQKV.apply(qkv, cos, sin, q_size, kv_size, head_dim)


def rotate_qkv_ref(
    qkv: Tensor, cos: Tensor, sin: Tensor, q_size: int, kv_size: int, head_dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    """`rotate_qkv` in torch ops (autograd differentiates it)."""
    _check_qkv(qkv, cos, sin, q_size, kv_size, head_dim)
    n, half = qkv.shape[0], head_dim // 2
    pos = torch.arange(n, device=qkv.device) % cos.shape[0]
    c, s = cos[pos][:, None, :], sin[pos][:, None, :]  # [N, 1, D/2]

    def rot(x: Tensor) -> Tensor:
        x = x.float().reshape(n, -1, head_dim)
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).reshape(n, -1).to(qkv.dtype)

    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return rot(q), rot(k), v.clone(memory_format=torch.contiguous_format)


def rotate_qkv(
    qkv: Tensor, cos: Tensor, sin: Tensor, q_size: int, kv_size: int, head_dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    """qkv [N, q_size + 2 kv_size] (float32 or bf16), cos, sin [P, head_dim / 2] float32
    -> (q [N, q_size], k [N, kv_size], v [N, kv_size]), new tensors in qkv's dtype: q's
    and k's heads RoPE-rotated (rotate-half) by row r % P of the tables, v a copy.
    Gradient for qkv. The kernels on CUDA, torch elsewhere."""
    if qkv.is_cuda:
        return rotate_qkv_triton(qkv, cos, sin, q_size, kv_size, head_dim)
    return rotate_qkv_ref(qkv, cos, sin, q_size, kv_size, head_dim)


def silu_mul_triton(gate_up: Tensor) -> Tensor:
    """`silu_mul` through the kernels (CUDA, or the Triton interpreter)."""
    return _SiluMul.apply(gate_up)


def silu_mul_ref(gate_up: Tensor) -> Tensor:
    """`silu_mul` in torch ops (autograd differentiates it)."""
    _check_silu(gate_up)
    gate, up = gate_up.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def silu_mul(gate_up: Tensor) -> Tensor:
    """gate_up [N, 2I] ([gate | up]) -> silu(gate) * up [N, I] in its dtype: float32 math,
    one rounding. Gradient for gate_up. The kernels on CUDA, torch elsewhere."""
    if gate_up.is_cuda:
        return silu_mul_triton(gate_up)
    return silu_mul_ref(gate_up)
