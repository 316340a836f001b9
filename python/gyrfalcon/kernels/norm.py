"""Triton RMSNorm and fused residual-add + RMSNorm.

Numerics follow `gyrfalcon.layers.norm.RMSNorm` (the HF recipe): the mean of
squares and the scaling run in float32, the normalized row is rounded to the
input dtype, and only then multiplied by the weight (in float32, rounded once
to the output dtype). The residual add of the fused variant is rounded to the
input dtype before it is normalized, exactly as `h = h + attn_out` would be.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gyrfalcon.kernels.device import launch_pdl
from gyrfalcon.kernels.pdl import pdl_gate

# Rows up to this many elements are normalized from registers in one pass;
# longer rows are streamed in chunks of _CHUNK elements (two passes over memory).
_MAX_SINGLE_BLOCK = 16384
_CHUNK = 8192


@triton.jit
def _rmsnorm_kernel(
    x_ptr,  # [R0, R1, H] input (or the "x" half of x + residual)
    res_ptr,  # [R0, R1, H] residual input (only read when HAS_RESIDUAL)
    w_ptr,  # [H]
    out_ptr,  # [R0, R1, H] normalized output
    res_out_ptr,  # [R0, R1, H] x + residual output (only written when HAS_RESIDUAL)
    sx0,
    sx1,
    sr0,
    sr1,
    so0,
    so1,
    sro0,
    sro1,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_gate(PDL)
    i0 = tl.program_id(0).to(tl.int64)
    i1 = tl.program_id(1).to(tl.int64)
    x_row = x_ptr + i0 * sx0 + i1 * sx1
    r_row = res_ptr + i0 * sr0 + i1 * sr1
    o_row = out_ptr + i0 * so0 + i1 * so1
    ro_row = res_out_ptr + i0 * sro0 + i1 * sro1
    dtype = x_ptr.dtype.element_ty
    offs = tl.arange(0, BLOCK)
    if NUM_CHUNKS == 1:
        mask = offs < H
        x = tl.load(x_row + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_row + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
            tl.store(ro_row + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
        normed = (xf * rstd).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(o_row + offs, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK + offs
            mask = cols < H
            x = tl.load(x_row + cols, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(r_row + cols, mask=mask, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
                tl.store(ro_row + cols, x, mask=mask)
            xf = x.to(tl.float32)
            acc += xf * xf
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / H + eps)
        # NOTE: with HAS_RESIDUAL the second pass re-reads the sum from res_out (the
        # inputs may already be overwritten when running in place); the barrier makes
        # the first pass's stores visible to every thread of the program.
        tl.debug_barrier()
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK + offs
            mask = cols < H
            if HAS_RESIDUAL:
                x = tl.load(ro_row + cols, mask=mask, other=0.0)
            else:
                x = tl.load(x_row + cols, mask=mask, other=0.0)
            normed = (x.to(tl.float32) * rstd).to(dtype).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(o_row + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def norm_launch_params(hidden: int, block_size: int | None) -> tuple[int, int, int]:
    """(BLOCK, NUM_CHUNKS, num_warps) for a row of `hidden` elements."""
    if block_size is None:
        p2 = triton.next_power_of_2(hidden)
        block_size = p2 if p2 <= _MAX_SINGLE_BLOCK else _CHUNK
    num_chunks = triton.cdiv(hidden, block_size)
    num_warps = 4 if block_size <= 1024 else (8 if block_size <= 4096 else 16)
    return block_size, num_chunks, num_warps


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    # [R, H] -> [R, 1, H] (a view; the middle stride is never stepped over)
    return t[:, None, :] if t.dim() == 2 else t


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    block_size: int | None = None,
    *,
    pdl: bool = True,
) -> torch.Tensor:
    """RMSNorm over the last dim of x: [T, H] or [T, N, H] (e.g. per-head q/k norm).

    x may be a strided view as long as its last dim is contiguous (a q or k slice
    of a fused qkv output works). Returns a new contiguous tensor in x.dtype unless
    `out` (same shape, last dim contiguous; it may be x itself, to normalize in
    place) is given. `block_size` (a power of two) forces the chunked path; it
    exists for tests. pdl: may launch with programmatic dependent launch (where the
    device supports it).
    """
    assert x.dim() in (2, 3) and x.stride(-1) == 1, "rmsnorm wants [T, H] or [T, N, H] rows"
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.is_contiguous()
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    assert out.shape == x.shape and out.stride(-1) == 1
    if x.numel() == 0:
        return out
    x3, o3 = _as_3d(x), _as_3d(out)
    block, chunks, warps = norm_launch_params(hidden, block_size)
    launch = launch_pdl(x, pdl)
    grid = (x3.shape[0], x3.shape[1])
    _rmsnorm_kernel[grid](
        x3, x3, weight, o3, o3,
        x3.stride(0), x3.stride(1), x3.stride(0), x3.stride(1),
        o3.stride(0), o3.stride(1), o3.stride(0), o3.stride(1),
        hidden, eps,
        HAS_RESIDUAL=False, BLOCK=block, NUM_CHUNKS=chunks, num_warps=warps,
        PDL=launch, launch_pdl=launch,
    )  # fmt: skip
    return out


def fused_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    inplace: bool = True,
    block_size: int | None = None,
    *,
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual) for x, residual: [T, H] of one dtype.

    With `inplace=True` (the default) the kernel writes the normalized rows into
    `x` and the new residual into `residual`, and returns those same tensors; no
    memory is allocated. With `inplace=False` both results are fresh tensors and
    the inputs are untouched. The sum is rounded to x.dtype before normalizing,
    matching `h = h + attn_out; norm(h)` in torch. pdl: as in `rmsnorm`.
    """
    assert x.dim() == 2 and x.shape == residual.shape and x.dtype == residual.dtype
    assert x.stride(-1) == 1 and residual.stride(-1) == 1, "rows must be contiguous"
    hidden = x.shape[-1]
    assert weight.shape == (hidden,) and weight.is_contiguous()
    if inplace:
        out, res_out = x, residual
    else:
        out, res_out = torch.empty_like(x), torch.empty_like(residual)
    if x.numel() == 0:
        return out, res_out
    block, chunks, warps = norm_launch_params(hidden, block_size)
    launch = launch_pdl(x, pdl)
    # NOTE: in place, each program reads its whole row (x and residual) before the
    # stores that overwrite it in the single-pass path; in the chunked path it only
    # overwrites chunks it has already consumed. Rows never overlap between programs.
    _rmsnorm_kernel[(x.shape[0], 1)](
        x, residual, weight, out, res_out,
        x.stride(0), 0, residual.stride(0), 0,
        out.stride(0), 0, res_out.stride(0), 0,
        hidden, eps,
        HAS_RESIDUAL=True, BLOCK=block, NUM_CHUNKS=chunks, num_warps=warps,
        PDL=launch, launch_pdl=launch,
    )  # fmt: skip
    return out, res_out
