"""ForwardBatch: everything one forward pass reads, built once per step.

NOTE: forwards only read these tensors; nothing mutates them after the
metadata builder returns (per-step metadata is owned by the step).
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
        )

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
