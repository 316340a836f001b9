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


def textbook(x: torch.Tensor, targets: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return -(torch.softmax(targets[rows].float(), -1) * F.log_softmax(x.float(), dim=-1)).sum(-1)


def case(n: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, vocab, generator=gen) * 4).to(dtype).requires_grad_()
    targets = (torch.randn(n + 3, vocab, generator=gen) * 3).to(dtype)
    rows = torch.randint(0, n + 3, (n,), generator=gen)  # repeats, any order
    weights = torch.rand(n, generator=gen)  # a weighted sum: per-row gradients differ
    return x, targets, rows, weights


def value_and_grad(fn, x, targets, rows, weights):
    x = x.detach().clone().requires_grad_()
    out = fn(x, targets, rows)
    ce = out[0] if isinstance(out, tuple) else out
    (ce * weights).sum().backward()
    return ce.detach(), x.grad


@pytest.mark.parametrize("fn", [soft_cross_entropy_triton, soft_cross_entropy_ref])
@pytest.mark.parametrize("vocab", [1, 7, BLOCK, BLOCK + 1, 2 * BLOCK + 100])
def test_matches_the_textbook_formula_in_float32(fn, vocab):
    x, targets, rows, w = case(5, vocab, torch.float32, seed=vocab)
    ce, grad = value_and_grad(fn, x, targets, rows, w)
    want_ce, want_grad = value_and_grad(textbook, x, targets, rows, w)
    assert ce.dtype == torch.float32 and grad.dtype == torch.float32
    torch.testing.assert_close(ce, want_ce, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-4)
    assert torch.equal(fn(x, targets, rows)[1], x.argmax(-1))


def test_bfloat16_logits_read_as_float32_and_gradient_in_bfloat16():
    """bf16 logits and targets (the trainer's autocast): the loss is that of their float32
    values, the gradient comes back in bf16, one rounding away from the float32 one."""
    x, targets, rows, w = case(6, BLOCK + 37, torch.bfloat16, seed=3)
    ce, grad = value_and_grad(soft_cross_entropy_triton, x, targets, rows, w)
    want_ce, want_grad = value_and_grad(textbook, x.float(), targets.float(), rows, w)
    torch.testing.assert_close(ce, want_ce, atol=1e-5, rtol=1e-5)
    assert grad.dtype == torch.bfloat16
    torch.testing.assert_close(grad.float(), want_grad, atol=1e-6, rtol=2**-7)


def test_peaked_rows_and_the_first_maximum_across_blocks():
    """Stable where one logit dwarfs the rest, in x and in the targets (the online
    log-sum-exps rescale across blocks), and the argmax is the first index of the
    maximum as torch's, also when the maximum repeats in a later block."""
    x, targets, rows, w = case(4, 2 * BLOCK + 5, torch.float32, seed=5)
    with torch.no_grad():
        x[1, 2 * BLOCK + 2] = 300.0  # the maximum in the last, ragged block
        x[2, 0] = -300.0
        x[3, [7, BLOCK + 7, 2 * BLOCK + 1]] = 50.0  # a tie across three blocks: 7 wins
        targets[rows[0], BLOCK + 3] = 200.0  # a peaked target in the second block
        targets[rows[1], 5] = -200.0
    ce, grad = value_and_grad(soft_cross_entropy_triton, x, targets, rows, w)
    want_ce, want_grad = value_and_grad(textbook, x, targets, rows, w)
    torch.testing.assert_close(ce, want_ce, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-4)
    argmax = soft_cross_entropy_triton(x, targets, rows)[1]
    assert argmax.tolist() == x.argmax(-1).tolist() and argmax[1] == 2 * BLOCK + 2
    assert argmax[3] == 7


def test_empty_batch_and_cpu_dispatch():
    x, targets, rows, w = case(3, 11, torch.float32)
    ce, argmax = soft_cross_entropy_triton(x[:0], targets, rows[:0])
    assert ce.shape == (0,) and argmax.shape == (0,)
    # on the CPU the public function is the torch path
    got, want = soft_cross_entropy(x, targets, rows), soft_cross_entropy_ref(x, targets, rows)
    torch.testing.assert_close(got[0], want[0])
    assert torch.equal(got[1], want[1])
