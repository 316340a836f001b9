"""Cross-entropy against the softmax of target logits, fused: the drafter trainer's
loss over its draft vocabulary (train/objective.py), forward and backward in one pass
over the row each, and the argmax of the logits on the way.

For logits x_i [V] and target logits t = targets[rows[i]] [V], p = softmax(t):

    ce_i = -sum_v p_v log_softmax(x_i)_v = lse(x_i) - sum_v p_v x_i[v]
    d ce_i / d x_i[v] = softmax(x_i)_v - p_v

The forward reads x and t once: online log-sum-exps of both, and sum_v e^(t_v - m) x_v
rescaled whenever the running maximum m of t grows (the dot with p is that sum over
sum_v e^(t_v - m)). It also keeps x's argmax (the first index of the maximum, as
torch.argmax): the trainer's acceptance needs the drafter's choice at every row and the
kernel reads the whole row anyway. The backward reads x and t once more and writes the
gradient in x's dtype. torch's composite (the target's float32 softmax over every
position, a float32 copy of x, log_softmax, the product, the sum, each one's backward)
moved about a dozen [n, V] float32 tensors through memory.

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
    t_ptr,  # [N, V] target logits, last dim contiguous
    rows_ptr,  # [n] int64: the row of t that scores row i of x
    ce_ptr,  # [n] float32 out
    lse_ptr,  # [n] float32 out: log-sum-exp of x_i
    tlse_ptr,  # [n] float32 out: log-sum-exp of t's row
    argmax_ptr,  # [n] int64 out: the first index of x_i's maximum
    vocab,
    stride_x,
    stride_t,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + i).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    # NOTE: the first block outside the loop: every loop-carried value starts as a
    # float32 scalar of the row (vocab >= 1, so the block holds a real entry)
    mask = offs < vocab
    x = tl.load(x_ptr + i * stride_x + offs, mask=mask, other=float("-inf")).to(tl.float32)
    t = tl.load(t_ptr + r * stride_t + offs, mask=mask, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    best = tl.argmax(x, 0).to(tl.int64)
    s = tl.sum(tl.exp(x - m), 0)
    mt = tl.max(t, 0)
    et = tl.exp(t - mt)
    st = tl.sum(et, 0)
    dot = tl.sum(et * tl.where(mask, x, 0.0), 0)
    for start in range(BLOCK, vocab, BLOCK):
        cols = start + offs
        mask = cols < vocab
        x = tl.load(x_ptr + i * stride_x + cols, mask=mask, other=float("-inf")).to(tl.float32)
        t = tl.load(t_ptr + r * stride_t + cols, mask=mask, other=float("-inf")).to(tl.float32)
        mx = tl.max(x, 0)
        best = tl.where(mx > m, start + tl.argmax(x, 0).to(tl.int64), best)  # NOTE: first wins
        m_new = tl.maximum(m, mx)
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
        mt_new = tl.maximum(mt, tl.max(t, 0))
        scale = tl.exp(mt - mt_new)
        et = tl.exp(t - mt_new)
        st = st * scale + tl.sum(et, 0)
        dot = dot * scale + tl.sum(et * tl.where(mask, x, 0.0), 0)
        mt = mt_new
    lse = m + tl.log(s)
    tl.store(ce_ptr + i, lse - dot / st)
    tl.store(lse_ptr + i, lse)
    tl.store(tlse_ptr + i, mt + tl.log(st))
    tl.store(argmax_ptr + i, best)


@triton.jit
def _soft_ce_bwd_kernel(
    g_ptr,  # [n] float32: d loss / d ce_i
    x_ptr,
    t_ptr,
    rows_ptr,
    lse_ptr,
    tlse_ptr,
    dx_ptr,  # [n, V] out, x's dtype, contiguous
    vocab,
    stride_x,
    stride_t,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    r = tl.load(rows_ptr + i).to(tl.int64)
    g = tl.load(g_ptr + i)
    lse = tl.load(lse_ptr + i)
    tlse = tl.load(tlse_ptr + i)
    offs = tl.arange(0, BLOCK)
    for start in range(0, vocab, BLOCK):
        cols = start + offs
        mask = cols < vocab
        x = tl.load(x_ptr + i * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        t = tl.load(t_ptr + r * stride_t + cols, mask=mask, other=0.0).to(tl.float32)
        dx = g * (tl.exp(x - lse) - tl.exp(t - tlse))
        tl.store(dx_ptr + i * vocab + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor) -> None:
    assert x.dim() == 2 and targets.dim() == 2 and rows.dim() == 1, (x.shape, targets.shape)
    assert x.shape[1] == targets.shape[1] >= 1 and rows.shape[0] == x.shape[0], (
        x.shape,
        targets.shape,
        rows.shape,
    )
    assert targets.is_floating_point() and rows.dtype == torch.int64, (targets.dtype, rows.dtype)


class _SoftCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        _check(x, targets, rows)
        x, targets = x.contiguous(), targets.contiguous()
        n, vocab = x.shape
        ce, lse, tlse = (torch.empty(n, dtype=torch.float32, device=x.device) for _ in range(3))
        argmax = torch.empty(n, dtype=torch.int64, device=x.device)
        if n:
            _soft_ce_fwd_kernel[(n,)](
                x, targets, rows, ce, lse, tlse, argmax, vocab, x.stride(0), targets.stride(0),
                BLOCK=BLOCK, num_warps=8,
            )  # fmt: skip
        ctx.save_for_backward(x, targets, rows, lse, tlse)
        ctx.mark_non_differentiable(argmax)
        return ce, argmax

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _argmax: None) -> tuple[torch.Tensor, None, None]:
        x, targets, rows, lse, tlse = ctx.saved_tensors
        n, vocab = x.shape
        dx = torch.empty_like(x)
        if n:
            _soft_ce_bwd_kernel[(n,)](
                grad.float().contiguous(), x, targets, rows, lse, tlse, dx, vocab,
                x.stride(0), targets.stride(0), BLOCK=BLOCK, num_warps=8,
            )  # fmt: skip
        return dx, None, None


def soft_cross_entropy_triton(
    x: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`soft_cross_entropy` through the kernels (CUDA, or the Triton interpreter)."""
    return _SoftCrossEntropy.apply(x, targets, rows)


def soft_cross_entropy_ref(
    x: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`soft_cross_entropy` in torch ops (autograd differentiates it)."""
    _check(x, targets, rows)
    x32, p = x.float(), torch.softmax(targets[rows].float(), dim=-1)
    return torch.logsumexp(x32, dim=-1) - (p * x32).sum(-1), x.detach().argmax(-1)


def soft_cross_entropy(
    x: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ce [n] float32, argmax [n] int64): ce_i = -sum_v p_v log_softmax(x[i])_v with
    p = softmax(targets[rows[i]]), for logits x [n, V] (any float dtype; the gradient
    comes back in it) and target logits targets [N, V] (any float dtype, no gradient);
    argmax_i the first index of x[i]'s maximum. The kernels on CUDA, torch elsewhere."""
    if x.is_cuda:
        return soft_cross_entropy_triton(x, targets, rows)
    return soft_cross_entropy_ref(x, targets, rows)
