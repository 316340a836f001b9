"""The Triton attention backend's per-step metadata (`TritonMeta`) and the host-side
rules it is built by: the decode kernel's split count (`decode_kv_splits`), which batches
run wholly on the decode kernel (`verify_tokens`), and when a MIXED batch's decode rows
join the extend kernel's launch (ONE_LAUNCH_MAX_KV_BYTES). triton_backend.py builds and
runs it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.kernels.attention_launch import DecodeScratch


@dataclass
class TritonMeta:
    page_table: torch.Tensor  # [bs, max_pages] int32 (int64 under graphs)
    # [bs] int32 (int64 under graphs), KV length of each row after this step (>= 1)
    seq_lens: torch.Tensor
    # of the extend rows [num_decode, bs) (VERIFY rows: all of them), int32 (int64 under
    # graphs): their page-table rows, KV lengths after this step (>= 1), each one's first
    # token's offset in [T], its new tokens (>= 1). Copies where num_decode > 0: they
    # start 16-byte aligned whatever num_decode, as Triton, specializing on pointer
    # alignment, needs to serve every mix of rows with one build of its kernel.
    ext_page_table: torch.Tensor
    ext_seq_lens: torch.Tensor
    q_starts: torch.Tensor
    q_lens: torch.Tensor
    max_q_len: int  # host value: the longest extend row (rows >= num_decode); sets its grid
    num_decode: int  # host value: batch.num_decode_rows (tokens [0, num_decode))
    scratch: DecodeScratch | None  # decode partials, rows [0, num_decode) used
    # host value: T > 0 when every row is T >= 2 query tokens (verify rows): the whole
    # batch then runs on the decode kernel, one query token per program row
    # (`decode_attention(tokens_per_row=T)`), scratch rows [0, bs * T) used
    verify_tokens: int = 0
    # host value: verify rows packed, one program per row and KV head holding its T
    # tokens (`decode_attention(pack=True)`; graph replays only, module docstring)
    packed: bool = False
    # every row on the extend kernel's flat grid (`prepare_any_rows`): q_lens may hold
    # spare rows of 0, and max_q_len is the token count
    flat: bool = False
    # a flat batch's decode rows on the decode kernel first (`prepare_any_rows`): [m]
    # int64, each of the first m rows' KV length where it is a decode row (tokens
    # [0, num decode rows)), else 0 (skipped; those rows' q_lens hold their work)
    flat_decode_lens: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        return self.num_decode == self.page_table.shape[0]


# NOTE: measured on nvidia-h200 (benchmarks/bench_attention.py, context 1024): about
# four programs per SM of 128-wide heads is where more splits stop paying. A program's
# work per key is its head's width: with the KV read from memory (`--cold-kv-bytes`, as
# a model's layers read it), 64-wide heads (SmolLM2) kept paying up to twice as many
# programs (bs 64: 22.5 -> 20.2 us at 4 splits, bs 128: 40.0 -> 36.0 at 2), where
# 128-wide ones (Llama-8B) lost 12% at one split more (bs 32). Widths outside [64, 128]
# were not measured and count as the nearer end.
PROGRAMS_PER_SM = 4
PROGRAM_WIDTH = 128  # the head width PROGRAMS_PER_SM counts in
MIN_PROGRAM_WIDTH = 64
MAX_KV_SPLITS = 16


def decode_kv_splits(batch_size: int, num_kv_heads: int, num_sms: int, head_dim: int) -> int:
    """Split-KV count of the decode kernel for a batch: the largest power of two
    <= MAX_KV_SPLITS with batch_size * num_kv_heads * splits programs, each weighing
    its head width in PROGRAM_WIDTH units (clamped to [MIN_PROGRAM_WIDTH,
    PROGRAM_WIDTH]), within PROGRAMS_PER_SM * num_sms; at least 1. Non-increasing in
    batch_size."""
    assert batch_size >= 1 and num_kv_heads >= 1 and num_sms >= 1 and head_dim >= 1
    width = min(max(head_dim, MIN_PROGRAM_WIDTH), PROGRAM_WIDTH)
    budget = PROGRAMS_PER_SM * num_sms * PROGRAM_WIDTH
    splits = 1
    while splits * 2 <= MAX_KV_SPLITS and batch_size * num_kv_heads * splits * 2 * width <= budget:
        splits *= 2
    return splits


# Verify rows of up to this many query tokens run on the decode kernel
MAX_VERIFY_TOKENS = 16

# A MIXED batch's decode rows join the extend kernel's launch (one launch a layer instead
# of two) while that kernel's reads of their KV, once per query head, stay under this
# many bytes. An eager step (a prompt arriving beside decoding rows) is bound by its
# host's launches; on a few short decode rows the launch saved outweighs the re-reads,
# on many long ones the decode kernel's split-KV reads win (benchmarks/NOTES.md).
ONE_LAUNCH_MAX_KV_BYTES = 32 << 20


def verify_tokens(mode: ForwardMode, q_lens: list[int]) -> int:
    """T when a VERIFY or DRAFT_EXTEND batch has T query tokens in every row, 2 <= T <=
    MAX_VERIFY_TOKENS (the decode kernel serves it: one program row per query token,
    split-KV, one program per KV head, where the extend kernel would read each row's
    KV once per query head); else 0."""
    if mode not in (ForwardMode.VERIFY, ForwardMode.DRAFT_EXTEND) or not q_lens:
        return 0
    t = q_lens[0]
    return t if 2 <= t <= MAX_VERIFY_TOKENS and q_lens.count(t) == len(q_lens) else 0
