"""ForwardBatch: everything one forward pass reads, built once per step.

NOTE: forwards only read these tensors; nothing mutates them after the
metadata builder returns (per-step metadata is owned by the step).

Backends dispatch on `mode`, never on shapes. Which rows attend as decodes is
explicit too: rows [0, num_decode_rows) carry one new token each and go to a
decode kernel; rows [num_decode_rows, bs) are extend rows (prefill chunks,
verify rows). `decode_rows` decides it once per step from the mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gyrfalcon.ipc.messages import ForwardMode

if TYPE_CHECKING:
    from gyrfalcon.forward.kv_cache import KVCache
    from gyrfalcon.forward.metadata import BatchTensors
    from gyrfalcon.layers.attention.base import AttentionBackend


# Modes whose rows carry exactly one new token each: every row attends as a decode.
SINGLE_TOKEN_MODES = frozenset({ForwardMode.DECODE, ForwardMode.DRAFT_DECODE})


def decode_rows(mode: ForwardMode, leading_single_rows: int, batch_size: int) -> int:
    """How many leading rows attend as decodes: all rows of a single-token mode, none of
    a VERIFY batch (its rows score k + 1 tokens, causal inside the row), the leading
    single-token rows of the rest (PREFILL, MIXED, DRAFT_EXTEND, IDLE: the scheduler
    puts decodes first)."""
    if mode in SINGLE_TOKEN_MODES:
        assert leading_single_rows == batch_size, f"{mode.name} rows carry one token each"
        return batch_size
    if mode == ForwardMode.VERIFY:
        return 0
    return leading_single_rows


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64, KV slot written by each new token
    seq_lens: torch.Tensor  # [bs] int64, KV length of each row after this step
    q_lens: torch.Tensor  # [bs] int64, new tokens of each row
    q_starts: torch.Tensor  # [bs] int64, offset of each row's first token in [T]
    page_table: torch.Tensor  # [bs, max_pages] int64, padded with the dummy page 0
    seq_lens_cpu: list[int]
    q_lens_cpu: list[int]
    page_size: int
    kv_cache: KVCache
    attn_backend: AttentionBackend
    num_decode_rows: int  # rows [0, n) have one new token each and attend as decodes
    attn_meta: Any = None  # built by attn_backend.build_metadata(self)

    @classmethod
    def from_tensors(
        cls,
        mode: ForwardMode,
        bt: BatchTensors,
        page_size: int,
        kv_cache: KVCache,
        attn_backend: AttentionBackend,
    ) -> ForwardBatch:
        """A batch over the metadata builder's tensors (attn_meta still to build)."""
        return cls(
            mode=mode,
            input_ids=bt.input_ids,
            positions=bt.positions,
            out_cache_loc=bt.out_cache_loc,
            seq_lens=bt.seq_lens,
            q_lens=bt.q_lens,
            q_starts=bt.q_starts,
            page_table=bt.page_table,
            seq_lens_cpu=bt.seq_lens_cpu,
            q_lens_cpu=bt.q_lens_cpu,
            page_size=page_size,
            kv_cache=kv_cache,
            attn_backend=attn_backend,
            num_decode_rows=decode_rows(mode, bt.leading_single_rows, len(bt.seq_lens_cpu)),
        )

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def check(self) -> None:
        """Shape and length assertions, host values only (no device syncs); every
        backend's metadata build runs them (spec-decode bug classes 4 and 5): the
        slots and positions match the token count, the lengths and q_lens the batch
        size, every row has 1 <= q_len <= seq_len <= its page table's capacity, and
        the decode rows come first with one token each."""
        bs, num_tokens = self.batch_size, self.num_tokens
        q_lens, seq_lens = self.q_lens_cpu, self.seq_lens_cpu
        assert bs >= 1, "empty batch"
        assert len(q_lens) == bs, (len(q_lens), bs)
        assert self.seq_lens.shape == (bs,), (self.seq_lens.shape, bs)
        assert self.q_lens.shape == (bs,) and self.q_starts.shape == (bs,), (
            self.q_lens.shape,
            self.q_starts.shape,
            bs,
        )
        assert self.page_table.dim() == 2 and self.page_table.shape[0] == bs, (
            self.page_table.shape,
            bs,
        )
        assert self.out_cache_loc.shape == (num_tokens,), (self.out_cache_loc.shape, num_tokens)
        assert self.positions.shape == (num_tokens,), (self.positions.shape, num_tokens)
        assert sum(q_lens) == num_tokens, (sum(q_lens), num_tokens)
        capacity = self.page_table.shape[1] * self.page_size
        ok = (
            min(q_lens) >= 1
            and max(seq_lens) <= capacity
            and all(map(int.__le__, q_lens, seq_lens))
        )
        assert ok, f"need 1 <= q_len <= seq_len <= {capacity}: q_lens {q_lens}, seq_lens {seq_lens}"
        nd = self.num_decode_rows
        assert 0 <= nd <= bs and q_lens[:nd].count(1) == nd, (
            f"decode rows [0, {nd}) must have one token each: {q_lens[:nd]}"
        )
        if self.mode in SINGLE_TOKEN_MODES:
            assert nd == bs == num_tokens, (self.mode.name, nd, bs, num_tokens)
