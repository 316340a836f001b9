"""Launch configurations of the skinny GEMM (`kernels/gemv.skinny_linear`): the tile,
warps and pipelining depth for x: [m, k] times w: [n, k].T, by a rule swept on an H100
and tables of swept bests for particular shapes and GPUs."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton

# tl.dot needs every operand dimension >= 16: the tensor-core path pads M to this.
DOT_MIN = 16


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # output columns (weight rows) per program
    block_k: int  # reduction elements per K step
    num_warps: int
    num_stages: int  # software-pipelining depth of the K loop
    use_dot: bool = True  # tensor cores (M padded to 16) vs CUDA-core FMAs

    def __post_init__(self) -> None:
        for v in (self.block_n, self.block_k, self.num_warps):
            assert v >= 1 and v & (v - 1) == 0, self
        assert self.num_stages >= 1, self
        if self.use_dot:
            assert self.block_n >= DOT_MIN and self.block_k >= DOT_MIN, self


# Shapes whose best swept config at m == 1 beats the rule below by more than 1%: the
# Llama-3.1-8B projections at tp 2, (n, k, act_silu_mul) -> config (bench_gemv on an
# H100, results/gemv_tp2_1dbfebc_nvidia-h100-x1.json; us default -> tuned: qkv 11.37 ->
# 10.57, o 8.22 -> 7.68, gate_up 40.69 -> 39.95, down + SiLU 22.73 -> 22.42)
_TUNED_M1 = {
    (3072, 4096, False): GemvConfig(4, 1024, num_warps=4, num_stages=4, use_dot=False),
    (4096, 2048, False): GemvConfig(64, 128, num_warps=4, num_stages=6, use_dot=True),
    (14336, 4096, False): GemvConfig(4, 512, num_warps=4, num_stages=4, use_dot=False),
    (4096, 7168, True): GemvConfig(4, 512, num_warps=4, num_stages=2, use_dot=False),
}


# Shapes whose swept best on an H200 (132 SMs as the H100, 4.6 TB/s of reads against
# 3.1) beat the rule by more than 3%: the Llama-3.1-8B tp-1 projections, (n, k,
# act_silu_mul, m == 1) -> config (bench_gemv, results/gemv_stop59_rule_eba1f82_nvidia-h200.json,
# confirmed by a second sweep; us rule -> tuned at M = 1: qkv 15.95 -> 14.03, o 11.48 ->
# 10.86, gate_up 59.44 -> 55.80; qkv at M = 4 and 16: 16.09 -> 14.30; the fused down over
# the whole FMA grid (--fused-grid), results/gemv_stop59_fused_c513b3c_nvidia-h200.json:
# 34.25 -> 32.09, twice the columns a program of the plain down's best). The tp-2 shapes
# keep `_TUNED_M1` (within 2% of best). In the model, batch-1 decode: 217.5 -> 232.0 tok/s
# without the fused down, 229.1 -> 232.3 with it on another H200
# (results/decode_llama8b_ab_h200gemv_*, results/decode_llama8b_ab_h200fused_*).
_TUNED_H200 = {
    (6144, 4096, False, True): GemvConfig(64, 128, num_warps=4, num_stages=5, use_dot=True),
    (4096, 4096, False, True): GemvConfig(64, 128, num_warps=4, num_stages=6, use_dot=True),
    (28672, 4096, False, True): GemvConfig(4, 256, num_warps=2, num_stages=2, use_dot=False),
    (4096, 14336, True, True): GemvConfig(8, 512, num_warps=8, num_stages=4, use_dot=False),
    (6144, 4096, False, False): GemvConfig(64, 128, num_warps=4, num_stages=5, use_dot=True),
}
# Tables of one model of GPU, by a word of its name (`device.gpu_name`; a whole word:
# "NVIDIA H200" and "NVIDIA H200 NVL", not "NVIDIA GH200 480GB"); they come first
_TUNED_BY_GPU = {"H200": _TUNED_H200}


@functools.lru_cache(maxsize=1024)
def gemv_config(
    m: int, n: int, k: int, num_sms: int, *, act_silu_mul: bool = False, gpu: str = ""
) -> GemvConfig:
    """Default config for x: [m, k] times w: [n, k].T on a GPU with num_sms SMs.

    The rule comes from sweeps of the bf16 Llama-3.1-8B and SmolLM2-135M
    projections on an H100 (benchmarks/bench_gemv.py; each pick was within 3.5%
    of the best swept config at every shape):
    - m == 1: CUDA-core FMAs, block_n 4 (many small programs: each SM holds
      several, which keeps its load queue full and makes the last wave short),
      block_k = min(next_pow2(k), 1024) (for small k one step covers all of K: the
      lowest latency), 8 warps (16 weight elements = two 16-byte vectors per
      thread at block_k 1024; fewer warps for narrower steps). Exception: when one
      step covers K and there are more than 4 programs per SM, 4 warps, so the
      whole grid stays resident in one wave (SmolLM2 gate_up: 3.6 vs 4.4 us).
    - m > 1: tensor cores (FMA count would grow with m): block_n 64, block_k 128,
      4 warps, 6 pipeline stages (123 KB of shared memory; the deepest swept):
      within 2.1% of the best at every swept shape, although N=4096 then gives
      only 64 programs (depth in flight matters more than filling every SM).
    - m > 1 with act_silu_mul: block_n 32, block_k 256, 8 warps, 4 stages: the
      padded [16, block_k] activation tile is recomputed by every program, and
      wider programs with more warps amortize it best. Even so the fused kernel
      loses to silu_and_mul + skinny_linear there (see FUSED_SILU_MUL_MAX_M).
    - m == 1 at a shape of `_TUNED_M1` on a GPU of 132 SMs (an H100): its swept best.
    - before all these, a shape of the table of `gpu` (its name) in `_TUNED_BY_GPU`.
    """
    assert m >= 1 and n >= 1 and k >= 1 and num_sms >= 1
    for word, table in _TUNED_BY_GPU.items():
        if word in gpu.split() and (n, k, act_silu_mul, m == 1) in table:
            return table[(n, k, act_silu_mul, m == 1)]
    tuned = _TUNED_M1.get((n, k, act_silu_mul)) if m == 1 and num_sms == 132 else None
    if tuned is not None:
        return tuned
    if m == 1:
        block_n, block_k = 4, min(triton.next_power_of_2(k), 1024)
        num_warps = max(1, min(8, block_n * block_k // 512))
        if k <= block_k and triton.cdiv(n, block_n) > 4 * num_sms:
            num_warps = max(1, num_warps // 2)
        return GemvConfig(block_n, block_k, num_warps, num_stages=3, use_dot=False)
    if act_silu_mul:
        block_k = max(DOT_MIN, min(triton.next_power_of_2(k), 256))
        return GemvConfig(32, block_k, num_warps=8, num_stages=4, use_dot=True)
    block_k = max(DOT_MIN, min(triton.next_power_of_2(k), 128))
    return GemvConfig(64, block_k, num_warps=4, num_stages=6, use_dot=True)
