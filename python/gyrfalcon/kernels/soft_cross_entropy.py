"""Cross-entropy against soft targets, fused: the drafter trainer's loss over its draft
vocabulary (train/objective.py), forward and backward in one pass over the row each.

For logits x_i [V] and the target distribution p = probs[rows[i]] [V], with s = sum p:

    ce_i = -sum_v p_v log_softmax(x_i)_v = lse(x_i) s - sum_v p_v x_i[v]
    d ce_i / d x_i[v] = softmax(x_i)_v s - p_v

(s is 1 for a distribution, up to rounding; carrying it keeps the two lines exact for
any p). torch's composite (a float32 copy of x, log_softmax, the gathered p, the
product, the sum, and each one's backward) moves about a dozen [n, V] float32 tensors
through memory; the kernels read x and p once forward (an online log-sum-exp) and
once backward, and write the gradient in x's dtype. On a GPU the loss of the trainer's
four unrolled steps over a 16k vocabulary was the largest part of a training step.

`soft_cross_entropy` takes the kernels on CUDA and the same math in torch elsewhere
(`soft_cross_entropy_ref`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048  # vocabulary entries a program reads at once


@triton.jit
def _soft_ce_fwd_kernel(
    x_ptr,  # [n, V] logits, last dim contiguous
    p_ptr,  # [N, V] float32 target distributions, last dim contiguous
    rows_ptr,  # [n] int64: the row of p that scores row i of x
    ce_ptr,  # [n] float32 out
    lse_ptr,  # [n] float32 out: log-sum-exp of x_i
    psum_ptr,  # [n] float32 out: sum of p's row
    vocab,
    stride_x,
    stride_p,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + i).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    # NOTE: the first block outside the loop: every loop-carried value starts as a
    # float32 scalar of the row (vocab >= 1, so the block holds a real entry)
    mask = offs < vocab
    x = tl.load(x_ptr + i * stride_x + offs, mask=mask, other=float("-inf")).to(tl.float32)
    p = tl.load(p_ptr + r * stride_p + offs, mask=mask, other=0.0)
    m = tl.max(x, 0)
    s = tl.sum(tl.exp(x - m), 0)
    dot = tl.sum(p * tl.where(mask, x, 0.0), 0)
    ps = tl.sum(p, 0)
    for start in range(BLOCK, vocab, BLOCK):
        cols = start + offs
        mask = cols < vocab
        x = tl.load(x_ptr + i * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
        p = tl.load(p_ptr + r * stride_p + cols, mask=mask, other=0.0)
        m_new = tl.maximum(m, tl.max(x, 0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
        dot += tl.sum(p * tl.where(mask, x, 0.0), 0)
        ps += tl.sum(p, 0)
    lse = m + tl.log(s)
    tl.store(ce_ptr + i, lse * ps - dot)
    tl.store(lse_ptr + i, lse)
    tl.store(psum_ptr + i, ps)


@triton.jit
def _soft_ce_bwd_kernel(
    g_ptr,  # [n] float32: d loss / d ce_i
    x_ptr,
    p_ptr,
    rows_ptr,
    lse_ptr,
    psum_ptr,
    dx_ptr,  # [n, V] out, x's dtype, contiguous
    vocab,
    stride_x,
    stride_p,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + i).to(tl.int64)
    g = tl.load(g_ptr + i)
    lse = tl.load(lse_ptr + i)
    ps = tl.load(psum_ptr + i)
    offs = tl.arange(0, BLOCK)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        mask = cols < vocab
        x = tl.load(x_ptr + i * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.load(p_ptr + r * stride_p + cols, mask=mask, other=0.0)
        dx = g * (tl.exp(x - lse) * ps - p)
        tl.store(dx_ptr + i * vocab + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor) -> None:
    assert x.dim() == 2 and probs.dim() == 2 and rows.dim() == 1, (x.shape, probs.shape)
    assert x.shape[1] == probs.shape[1] >= 1 and rows.shape[0] == x.shape[0], (
        x.shape,
        probs.shape,
        rows.shape,
    )
    assert probs.dtype == torch.float32 and rows.dtype == torch.int64, (probs.dtype, rows.dtype)


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        _check(x, probs, rows)
        x, probs = x.contiguous(), probs.contiguous()
        n, vocab = x.shape
        ce, lse, psum = (torch.empty(n, dtype=torch.float32, device=x.device) for _ in range(3))
        if n:
            _soft_ce_fwd_kernel[(n,)](
                x, probs, rows, ce, lse, psum, vocab, x.stride(0), probs.stride(0),
                BLOCK=BLOCK, num_warps=8,
            )  # fmt: skip
        ctx.save_for_backward(x, probs, rows, lse, psum)
        return ce

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, probs, rows, lse, psum = ctx.saved_tensors
        n, vocab = x.shape
        dx = torch.empty_like(x)
        if n:
            _soft_ce_bwd_kernel[(n,)](
                grad.float().contiguous(), x, probs, rows, lse, psum, dx, vocab,
                x.stride(0), probs.stride(0), BLOCK=BLOCK, num_warps=8,
            )  # fmt: skip
        return dx, None, None


def soft_cross_entropy_triton(
    x: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """`soft_cross_entropy` through the kernels (CUDA, or the Triton interpreter)."""
    return _SoftCrossEntropy.apply(x, probs, rows)


def soft_cross_entropy_ref(
    x: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor
) -> torch.Tensor:
    """`soft_cross_entropy` in torch ops (autograd differentiates it)."""
    _check(x, probs, rows)
    x, p = x.float(), probs[rows]
    return torch.logsumexp(x, dim=-1) * p.sum(-1) - (p * x).sum(-1)


def soft_cross_entropy(x: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """ce [n] float32: -sum_v probs[rows[i], v] log_softmax(x[i])_v for logits x [n, V]
    (any float dtype; the gradient comes back in it) and target distributions probs
    [N, V] float32 (no gradient). The kernels on CUDA, torch elsewhere."""
    if x.is_cuda:
        return soft_cross_entropy_triton(x, probs, rows)
    return soft_cross_entropy_ref(x, probs, rows)
