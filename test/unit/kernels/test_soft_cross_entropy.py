"""Soft-target cross-entropy (the drafter trainer's loss): the Triton kernels (CPU
interpreter) and the torch path against the textbook formula, value and gradient."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: must precede every triton import

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from gyrfalcon.kernels.soft_cross_entropy import (  # noqa: E402
    BLOCK,
    soft_cross_entropy,
    soft_cross_entropy_ref,
    soft_cross_entropy_triton,
)


def textbook(x: torch.Tensor, probs: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return -(probs[rows] * F.log_softmax(x.float(), dim=-1)).sum(-1)


def case(n: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, vocab, generator=gen) * 4).to(dtype).requires_grad_()
    probs = torch.softmax(torch.randn(n + 3, vocab, generator=gen) * 3, dim=-1)
    rows = torch.randint(0, n + 3, (n,), generator=gen)  # repeats, any order
    weights = torch.rand(n, generator=gen)  # a weighted sum: per-row gradients differ
    return x, probs, rows, weights


def value_and_grad(fn, x, probs, rows, weights):
    x = x.detach().clone().requires_grad_()
    ce = fn(x, probs, rows)
    (ce * weights).sum().backward()
    return ce.detach(), x.grad


@pytest.mark.parametrize("fn", [soft_cross_entropy_triton, soft_cross_entropy_ref])
@pytest.mark.parametrize("vocab", [1, 7, BLOCK, BLOCK + 1, 2 * BLOCK + 100])
def test_matches_the_textbook_formula_in_float32(fn, vocab):
    x, probs, rows, w = case(5, vocab, torch.float32, seed=vocab)
    ce, grad = value_and_grad(fn, x, probs, rows, w)
    want_ce, want_grad = value_and_grad(textbook, x, probs, rows, w)
    assert ce.dtype == torch.float32 and grad.dtype == torch.float32
    torch.testing.assert_close(ce, want_ce, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-4)


def test_bfloat16_logits_read_as_float32_and_gradient_in_bfloat16():
    """bf16 logits (the trainer's autocast): the loss is that of their float32 values,
    the gradient comes back in bf16, one rounding away from the float32 one."""
    x, probs, rows, w = case(6, BLOCK + 37, torch.bfloat16, seed=3)
    ce, grad = value_and_grad(soft_cross_entropy_triton, x, probs, rows, w)
    want_ce, want_grad = value_and_grad(textbook, x.float(), probs, rows, w)
    torch.testing.assert_close(ce, want_ce, atol=1e-5, rtol=1e-5)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), want_grad, atol=1e-6, rtol=2**-7)


def test_unnormalized_targets_and_peaked_rows():
    """Exact for any p (the sum of p scales the log-sum-exp), and stable where one
    logit dwarfs the rest (the online log-sum-exp rescales across blocks)."""
    x, probs, rows, w = case(4, 2 * BLOCK + 5, torch.float32, seed=5)
    probs = probs * 0.5
    probs[0] = 0.0  # a row no target reaches: zero loss, zero gradient
    rows[0] = 0
    with torch.no_grad():
        x[1, 2 * BLOCK + 2] = 300.0  # the maximum in the last, ragged block
        x[2, 0] = -300.0
    ce, grad = value_and_grad(soft_cross_entropy_triton, x, probs, rows, w)
    want_ce, want_grad = value_and_grad(textbook, x, probs, rows, w)
    torch.testing.assert_close(ce, want_ce, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-4)
    assert ce[0] == 0 and not grad[0].any()


def test_empty_batch_and_cpu_dispatch():
    x, probs, rows, w = case(3, 11, torch.float32)
    empty = soft_cross_entropy_triton(x[:0], probs, rows[:0])
    assert empty.shape == (0,)
    # on the CPU the public function is the torch path
    torch.testing.assert_close(
        soft_cross_entropy(x, probs, rows), soft_cross_entropy_ref(x, probs, rows)
    )
