"""Triton SiLU-and-multiply for the gated MLP ([gate | up] -> silu(gate) * up).

Numerics follow `gyrfalcon.layers.activation.silu_and_mul` on half-precision
inputs: silu is evaluated in float32 and rounded to the input dtype, then the
product with `up` is evaluated in float32 and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [T, 2I], last dim contiguous
    out_ptr,  # [T, I], last dim contiguous
    sx,
    so,
    inter,  # I
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = x_ptr.dtype.element_ty
    row = x_ptr + t * sx
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + t * so + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, 2I] laid out as [gate | up] -> silu(gate) * up: [T, I] in x.dtype.

    x may have any row stride (last dim contiguous). `out` ([T, I], last dim
    contiguous) is written instead of allocating when given.
    """
    assert x.dim() == 2 and x.shape[-1] % 2 == 0 and x.stride(-1) == 1
    num_tokens, inter = x.shape[0], x.shape[-1] // 2
    if out is None:
        out = torch.empty((num_tokens, inter), dtype=x.dtype, device=x.device)
    assert out.shape == (num_tokens, inter) and out.stride(-1) == 1
    if out.numel() == 0:
        return out
    block = min(1024, triton.next_power_of_2(inter))
    grid = (num_tokens, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4 if block <= 512 else 8
    )
    return out
