"""What the attention kernels' launches take besides their tensors: the decode
kernel's scratch (`DecodeScratch`), its RoPE inputs (`DecodeRope`), its block sizes and
compile-time arguments (`decode_constexprs`), when verify rows pack (`packs`), and the
dot precision and log base both kernels share. Host-side only: no kernel here
(kernels/attention_decode.py, attention_extend.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import triton

from gyrfalcon.kernels.device import launch_pdl, num_sms
from gyrfalcon.kernels.split_merge import merge_heads_per_tile

LOG2E = 1.4426950408889634
# verify rows pack their T tokens' query heads of a KV head into one program's block
# (`PACK`) while T x GROUP is at most this many rows
MAX_PACKED_ROWS = 64


def packs(tokens_per_row: int, group: int) -> bool:
    """Whether verify rows of `tokens_per_row` tokens can run packed (kernels/
    attention_decode.py) for a GQA group of `group` query heads per KV head."""
    return tokens_per_row > 1 and tokens_per_row * group <= MAX_PACKED_ROWS


@dataclass
class DecodeScratch:
    """Caller-owned split partials, reusable across layers and steps (launches on one
    stream: each launch merges its partials before it ends)."""

    mid_o: torch.Tensor  # [max_bs, H, num_kv_splits, D] float32
    mid_lse: torch.Tensor  # [max_bs, H, num_kv_splits] float32 (base-2 log-sum-exp)
    # [max_bs, H] int32, zero between launches: splits finished per (row, KV head)
    # (columns [0, KVH) used); the last program of a pair sets it back to 0
    counts: torch.Tensor

    @property
    def num_kv_splits(self) -> int:
        return int(self.mid_lse.shape[2])


def alloc_decode_scratch(
    max_bs: int, num_heads: int, head_dim: int, num_kv_splits: int, device: torch.device
) -> DecodeScratch:
    """Scratch for `decode_attention` on batches of up to max_bs rows."""
    assert max_bs >= 1 and num_kv_splits >= 1, (max_bs, num_kv_splits)
    return DecodeScratch(
        mid_o=torch.empty(
            (max_bs, num_heads, num_kv_splits, head_dim), dtype=torch.float32, device=device
        ),
        mid_lse=torch.empty((max_bs, num_heads, num_kv_splits), dtype=torch.float32, device=device),
        counts=torch.zeros((max_bs, num_heads), dtype=torch.int32, device=device),
    )


@dataclass
class DecodeRope:
    """What `decode_attention` needs to apply RoPE and write the new K/V itself (the
    launch `rotary_and_store` would cost): q is then the raw (unrotated) query."""

    k: torch.Tensor  # [bs, KVH, D] the new tokens' k before RoPE (head dim contiguous)
    v: torch.Tensor  # [bs, KVH, D]
    positions: torch.Tensor  # [bs] int, the new tokens' positions (= seq_lens - 1)
    cos_sin: torch.Tensor  # [max_pos, D] float32, `build_cos_sin_cache`
    loc: torch.Tensor  # [bs] int, the new tokens' cache slots


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact (IEEE) dots instead of tf32; 16-bit inputs ignore this."""
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_block_params(block_d: int, fp8: bool) -> tuple[int, int]:
    """(keys per loop iteration, pipeline stages) of the decode kernel.

    Measured on an H100 (benchmarks/NOTES.md, Llama-8B heads, context 2048): an fp8
    cache runs fastest with 128 keys and 3 stages (446 vs 545 us at batch 256, 120
    vs 181 us at 64); a 16-bit one is at the bandwidth with 64 keys and 2 stages.
    Wider heads take half the keys (shared memory)."""
    if block_d > 128:
        return 32, 2
    return (128, 3) if fp8 else (64, 2)


# The decode kernel's first key block before its PDL gate costs registers (SmolLM2's
# 64-wide bf16 heads at 4 warps: 168 -> 241 a thread; packed verify rows 180 -> 255 and
# 24 bytes of stack; 128-wide heads or an fp8 cache spill 1-4 KiB), so it is read early
# only where those bind nothing: a grid of at most one program per SM (no occupancy to
# lose) over 16-bit caches of heads up to this wide, rows not packed.
EARLY_KV_MAX_HEAD_DIM = 64


def early_kv_block(
    programs: int, num_sms: int, head_dim: int, fp8: bool, pdl: bool, packed: bool
) -> bool:
    """Whether a decode launch of `programs` programs reads each split's first key block
    before its PDL gate (`_decode_split_kernel`'s EARLY_KV): with PDL, a 16-bit cache,
    heads of at most EARLY_KV_MAX_HEAD_DIM, rows not packed (unmeasured there) and
    programs <= num_sms. Measured on
    nvidia-h200 (SmolLM2 shape, benchmarks/NOTES.md stop 66): early in every build,
    batch 1 +3.0% tok/s and batch 16 (a grid larger than the GPU) -0.6%; by this rule
    batch 1 +2.1%, batch 2 +3.7%, batch 16 unchanged."""
    small = programs <= num_sms and head_dim <= EARLY_KV_MAX_HEAD_DIM
    return pdl and small and not fp8 and not packed


def early_first_block(
    program_rows: int, k_cache: torch.Tensor, splits: int, pdl: bool, packed: bool
) -> bool:
    """Whether a decode launch of program_rows x KV heads x splits programs over k_cache
    ([slots, KVH, D]) builds with EARLY_KV (`early_kv_block`); pdl and packed as
    `decode_attention` takes them."""
    _, kvh, head_dim = k_cache.shape
    programs, fp8 = program_rows * kvh * splits, k_cache.element_size() == 1
    pdl = launch_pdl(k_cache, pdl)
    return early_kv_block(programs, num_sms(k_cache.device), head_dim, fp8, pdl, packed)


@lru_cache(maxsize=256)  # NOTE: called per layer in eager steps; a launch only reads it
def decode_constexprs(
    head_dim: int,
    group: int,
    tokens_per_row: int,
    pack: bool,
    splits: int,
    page_size: int,
    q_dtype: torch.dtype,
    fp8: bool,
    rope: bool,
    pdl: bool,
    block_n: int | None = None,
    num_stages: int | None = None,
    early_kv: bool = False,
) -> tuple[dict, int]:
    """(the decode kernel's compile-time arguments, its pipeline stages) for a launch of
    `decode_attention` with these parameters: each distinct pair is a build of its own.
    block_n, num_stages: None = `decode_block_params`; early_kv: `early_kv_block`.
    Cached: the dict is shared, never to be changed."""
    t = tokens_per_row
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
    default_n, default_stages = decode_block_params(block_d, fp8)
    consts = dict(
        GROUP=group, PACK=pack, BLOCK_T=triton.next_power_of_2(t) if pack else 1,
        HEAD_DIM=head_dim, PAGE_SIZE=page_size, NUM_SPLITS=splits,
        BLOCK_H=max(16, triton.next_power_of_2(t * group if pack else group)),
        BLOCK_N=default_n if block_n is None else block_n, BLOCK_D=block_d,
        BLOCK_G=merge_heads_per_tile(group, splits, block_d),
        BLOCK_S=triton.next_power_of_2(splits),
        PRECISION=dot_precision(q_dtype),
        ROPE=rope, EARLY_KV=early_kv, F16_MATH=fp8 and q_dtype.itemsize == 2, PDL=pdl,
    )  # fmt: skip
    return consts, default_stages if num_stages is None else num_stages
