"""Triton skinny GEMM (GEMV-like) for decode: y = x @ w.T with a few rows in x.

In a decode step every linear layer sees x: [M, K] with M = the number of running
sequences (1..16 here) and a weight w: [N, K] that is read once per step, so the
layer costs the time to stream w from memory. cuBLAS picks split-K plus a
separate reduce kernel for these shapes; `skinny_linear` does the whole product
in ONE launch: each program owns BLOCK_N output columns for all M rows and walks
K in BLOCK_K steps (weight tile loads coalesced along K, the x chunk loaded once
per step and reused by all BLOCK_N rows), accumulating in float32.

Two inner products, chosen by `GemvConfig.use_dot`:
- CUDA-core FMAs (M == 1): a [BLOCK_N, BLOCK_K] float32 partial-sum tile, reduced
  across threads once, after the K loop. For 1 < M <= 16 the FMA path reduces a
  [M, BLOCK_N, BLOCK_K] product every step instead (slower than tensor cores
  except at M=2 on SmolLM2-sized weights; kept for sweeps).
- tensor cores: tl.dot(w_tile, x_chunk.T) with M padded to 16 rows (the "swap AB"
  form: the weight rows are the MMA's M dimension), so the FMA count does not
  grow with M.

Measured on an H100 (bf16, in CUDA graphs, weights not in L2; read bandwidth of a
streaming kernel 3.13 TB/s): Llama-3.1-8B gate_up (235 MB) at 97% of it at M=1
and 92-94% at M=2..16, down (117 MB) 88-89%, qkv/o (50/34 MB) 75-83% (a few us
of ramp-up and tail per launch weigh more there); faster than cuBLAS on every
Llama-3.1-8B and SmolLM2-135M projection for M=1..16 (SmolLM2 o at M=1: 2.4 vs
3.6 us).

`act_silu_mul=True` fuses the gated-MLP activation into the down projection: x is
the gate_up output [M, 2K] laid out [gate | up], and the kernel multiplies w by
silu(gate) * up computed on the fly with the numerics of
`gyrfalcon.kernels.activation.silu_and_mul` (silu in float32 rounded to x.dtype,
then the product in float32 rounded to x.dtype), so the result equals the
unfused silu_and_mul + linear up to the summation order. Every program recomputes
the activation of the whole [M, 2K] input, which only pays at M <= FUSED_SILU_MUL_MAX_M.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gyrfalcon.kernels.device import gpu_name, launch_pdl, num_sms
from gyrfalcon.kernels.gemv_config import DOT_MIN, GemvConfig, gemv_config
from gyrfalcon.kernels.pdl import pdl_gate

# Largest row count `skinny_linear` accepts; larger decode batches go to cuBLAS.
MAX_SKINNY_M = 16
# Largest M at which act_silu_mul (fused down projection) beat silu_and_mul followed
# by skinny_linear on an H100 (Llama-3.1-8B down at M=1: 42.9 vs 44.4 us, vs 46.8 us
# for silu_and_mul + cuBLAS; at M=8: 62.5 vs 45.8 us). Larger M: don't fuse.
FUSED_SILU_MUL_MAX_M = 1


@triton.jit
def silu_mul_rounded(gate, up, dtype: tl.constexpr):
    """silu(gate) * up in dtype, rounded as `silu_and_mul` rounds (float32 math)."""
    gate = gate.to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(dtype)


@triton.jit
def _skinny_k_step(
    acc, w, x_ptrs, k_mask, m_mask, gate_next, up_next, K, k0,
    ACT_SILU_MUL: tl.constexpr, USE_DOT: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One K step of `_skinny_gemm_kernel`: acc plus the step's weight tile w times its
    activations (x at x_ptrs, or SiLU*up of the prefetched gate/up, then the next
    step's prefetched); returns (acc, gate_next, up_next)."""
    if ACT_SILU_MUL:
        gate, up = gate_next, up_next
        x_mask = m_mask & (tl.arange(0, BLOCK_K)[None, :] < K - k0 - BLOCK_K)  # empty last
        gate_next = tl.load(x_ptrs + BLOCK_K, mask=x_mask, other=0.0)
        up_next = tl.load(x_ptrs + BLOCK_K + K, mask=x_mask, other=0.0)
        a = silu_mul_rounded(gate, up, x_ptrs.dtype.element_ty)
    else:
        a = tl.load(x_ptrs, mask=m_mask & k_mask, other=0.0)
    if USE_DOT and DOT_F32:
        # exact float32 products: for float32 inputs, and for every dtype under
        # the interpreter (see skinny_linear)
        acc = tl.dot(w.to(tl.float32), tl.trans(a.to(tl.float32)), acc, input_precision="ieee")
    elif USE_DOT:
        acc = tl.dot(w, tl.trans(a), acc)  # half-precision MMA, float32 accumulator
    elif BLOCK_M == 1:
        # partial sums stay per (row, k lane): no cross-thread traffic in the loop
        acc += w.to(tl.float32) * a.to(tl.float32)
    else:
        prod = w.to(tl.float32)[None, :, :] * a.to(tl.float32)[:, None, :]
        acc += tl.sum(prod, axis=2)
    return acc, gate_next, up_next


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr,  # [M, K] ([M, 2K] = [gate | up] when ACT_SILU_MUL), last dim contiguous
    w_ptr,  # [N, K] contiguous
    y_ptr,  # [M, N], last dim contiguous
    M,
    N,
    K,
    s_xm,
    s_ym,
    ACT_SILU_MUL: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Columns past N re-read weight row N-1 (in bounds, never stored): the weight
    # loads need a mask along K only.
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w_ptrs = w_ptr + rows[:, None] * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    k_mask = offs_k[None, :] < K
    if not USE_DOT:
        # NOTE: the CUDA-core path loads its first K step's weights (all of K for a
        # small model) before the gate, while the previous kernel ends: constant, so
        # safe (test_pdl_gate). Not the tensor-core path: peeled there, the fused
        # SiLU build spilled and SmolLM2 at batch 16 lost 11% (nvidia-h200).
        w = tl.load(w_ptrs, mask=k_mask, other=0.0)
    pdl_gate(PDL)
    x_ptrs = x_ptr + offs_m[:, None] * s_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    m_mask = offs_m[:, None] < M
    if USE_DOT:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    elif BLOCK_M == 1:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    gate_next = x_ptrs  # NOTE: placeholders unless ACT_SILU_MUL
    up_next = x_ptrs
    if ACT_SILU_MUL:
        # NOTE: gate/up feed elementwise math, not the dot, so triton's pipeliner
        # leaves their loads synchronous; they are prefetched one K step ahead by
        # hand instead (without it the fused tensor-core path ran 2.5x slower on H100).
        x_mask = m_mask & k_mask
        gate_next = tl.load(x_ptrs, mask=x_mask, other=0.0)
        up_next = tl.load(x_ptrs + K, mask=x_mask, other=0.0)
    k_first = 0
    if not USE_DOT:  # the first step, its weights loaded above
        acc, gate_next, up_next = _skinny_k_step(
            acc, w, x_ptrs, k_mask, m_mask, gate_next, up_next, K, 0,
            ACT_SILU_MUL, USE_DOT, DOT_F32, BLOCK_M, BLOCK_K,
        )  # fmt: skip
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        k_first = BLOCK_K
    for k0 in range(k_first, K, BLOCK_K):
        k_mask = offs_k[None, :] < K - k0
        w = tl.load(w_ptrs, mask=k_mask, other=0.0)
        acc, gate_next, up_next = _skinny_k_step(
            acc, w, x_ptrs, k_mask, m_mask, gate_next, up_next, K, k0,
            ACT_SILU_MUL, USE_DOT, DOT_F32, BLOCK_M, BLOCK_K,
        )  # fmt: skip
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if USE_DOT:
        out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    elif BLOCK_M == 1:
        out = tl.sum(acc, axis=1)[None, :]
    else:
        out = acc
    y_ptrs = y_ptr + offs_m[:, None] * s_ym + offs_n[None, :]
    tl.store(y_ptrs, out.to(y_ptr.dtype.element_ty), mask=m_mask & (offs_n[None, :] < N))


def skinny_linear(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    config: GemvConfig | None = None,
    act_silu_mul: bool = False,
    out: torch.Tensor | None = None,
    pdl: bool = True,
) -> torch.Tensor:
    """x @ w.T for a few rows of x, in one kernel launch; returns [M, N] in x.dtype.

    x: [M, K] with 1 <= M <= MAX_SKINNY_M (any row stride, last dim contiguous);
    w: [N, K] contiguous, same dtype as x. Accumulates in float32. With
    act_silu_mul, x is [M, 2K] laid out [gate | up] and the product is
    (silu(gate) * up) @ w.T, the activation rounded to x.dtype as
    `silu_and_mul` does (only faster than silu_and_mul + skinny_linear for
    M <= FUSED_SILU_MUL_MAX_M). config: None picks `gemv_config(M, N, K, #SMs,
    act_silu_mul=act_silu_mul, gpu=<its name>)`.
    out ([M, N], last dim contiguous, x.dtype) is written instead of allocating.
    pdl: may launch with programmatic dependent launch (where the device supports it).
    """
    assert x.dim() == 2 and w.dim() == 2, (x.shape, w.shape)
    assert x.stride(-1) == 1, "x: last dim must be contiguous"
    assert w.is_contiguous(), "w must be contiguous"
    assert x.dtype == w.dtype and x.device == w.device, (x.dtype, w.dtype, x.device, w.device)
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    assert x.shape[1] == (2 * k if act_silu_mul else k), (x.shape, w.shape, act_silu_mul)
    assert m <= MAX_SKINNY_M, f"skinny_linear handles at most {MAX_SKINNY_M} rows, got {m}"
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(-1) == 1 and out.dtype == x.dtype
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    cfg = config
    if cfg is None:
        sms, gpu = num_sms(x.device), gpu_name(x.device)
        cfg = gemv_config(m, n, k, sms, act_silu_mul=act_silu_mul, gpu=gpu)
    # NOTE: triton's interpreter (CPU tensors) multiplies bfloat16 dot operands as
    # their raw uint16 bits, so off the GPU the tensor-core path upcasts them to
    # float32 first (bf16 x bf16 products are exact in float32 either way).
    block_m = DOT_MIN if cfg.use_dot else triton.next_power_of_2(m)
    launch = launch_pdl(x, pdl)
    _skinny_gemm_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, w, out, m, n, k, x.stride(0), out.stride(0),
        ACT_SILU_MUL=act_silu_mul, USE_DOT=cfg.use_dot,
        DOT_F32=x.dtype == torch.float32 or not x.is_cuda,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, PDL=launch, launch_pdl=launch,
    )  # fmt: skip
    return out


# Widest input row `norm_skinny_linear` takes: the whole row is one K step in registers.
NORM_FUSED_MAX_K = 1024


@triton.jit
def _norm_gemv_kernel(
    h_ptr,  # [K] the layer input (the residual stream's next delta)
    res_ptr,  # [K] the residual (read when HAS_RES)
    gamma_ptr,  # [K] the RMSNorm weight
    w_ptr,  # [N, K] contiguous
    y_ptr,  # [N]
    res_out_ptr,  # [K] h + residual (written by program 0 when HAS_RES)
    N,
    K,
    eps,
    HAS_RES: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    dtype = h_ptr.dtype.element_ty
    # the weights first: constant, so with PDL they load while the previous kernel ends
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)
    w = tl.load(w_ptr + rows[:, None] * K + offs_k[None, :], mask=k_mask[None, :], other=0.0)
    g = tl.load(gamma_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    pdl_gate(PDL)
    # every program normalizes the (short) row itself, with the norm kernel's roundings
    x = tl.load(h_ptr + offs_k, mask=k_mask, other=0.0)
    if HAS_RES:
        r = tl.load(res_ptr + offs_k, mask=k_mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        if pid == 0:  # NOTE: out of place: other programs still read h and residual
            tl.store(res_out_ptr + offs_k, x, mask=k_mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / K + eps)
    normed = (xf * rstd).to(dtype).to(tl.float32)
    a = (g * normed).to(dtype).to(tl.float32)  # the norm's output, as rmsnorm rounds it
    y = tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    tl.store(y_ptr + offs_n, y.to(y_ptr.dtype.element_ty), mask=offs_n < N)


def norm_skinny_linear(
    h: torch.Tensor,
    residual: torch.Tensor | None,
    gamma: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    *,
    pdl: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(h + residual) @ w.T, h + residual) for ONE row, in one launch.

    The launch that `fused_add_rmsnorm` (or `rmsnorm` when residual is None: the
    residual is then h itself) would cost is saved: each program normalizes the row
    (K <= NORM_FUSED_MAX_K) from registers with the norm kernel's roundings, then
    multiplies its BLOCK_N weight rows. h, residual: [1, K]; gamma: [K]; w: [N, K]
    contiguous, all one dtype. The new residual is a fresh tensor (program 0 writes it
    while the others still read the inputs). pdl: as in `skinny_linear`.
    """
    assert h.dim() == 2 and h.shape[0] == 1 and h.stride(-1) == 1, h.shape
    k, n = h.shape[1], w.shape[0]
    assert 1 <= k <= NORM_FUSED_MAX_K and w.shape == (n, k) and w.is_contiguous(), (
        h.shape,
        w.shape,
    )
    assert gamma.shape == (k,) and gamma.is_contiguous() and gamma.dtype == h.dtype == w.dtype
    if residual is not None:
        assert residual.shape == h.shape and residual.stride(-1) == 1
        assert residual.dtype == h.dtype
    res_out = h if residual is None else torch.empty_like(h)
    y = torch.empty((1, n), dtype=h.dtype, device=h.device)
    cfg = gemv_config(1, n, k, num_sms(h.device))
    assert cfg.block_k >= k  # one K step (gemv_config: block_k = next_pow2(k) <= 1024)
    launch = launch_pdl(h, pdl)
    _norm_gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        h, h if residual is None else residual, gamma, w, y, res_out, n, k, eps,
        HAS_RES=residual is not None, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, PDL=launch, launch_pdl=launch,
    )  # fmt: skip
    return y, res_out
