"""Attention backend interface.

A backend owns its per-step metadata: `build_metadata` runs once per step
(before the first layer) and every layer's `forward` only reads it. It
dispatches on `batch.mode` (and the explicit `batch.num_decode_rows`), never on
the shapes of the batch.

A model holds one backend instance per role (registry.RoleBackends: extend,
decode, verify), so the plan of one role's step never overwrites another's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from gyrfalcon.forward.batch import SINGLE_TOKEN_MODES, ForwardBatch
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.ipc.messages import ForwardMode

# The modes graphs are captured for: DECODE (one query token per row), VERIFY (k + 1),
# DRAFT_EXTEND (a drafter's round over verify rows: k + 1 per row) and DRAFT_DECODE (a
# drafter's steps after an eager extend, one row per proposing request; worker/drafter.py)
CAPTURED_MODES = (
    ForwardMode.DECODE, ForwardMode.VERIFY, ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_DECODE
)  # fmt: skip


def check_capture(mode: ForwardMode, tokens_per_row: int) -> None:
    """A capture request a backend can serve: DECODE and DRAFT_DECODE of one token per
    row, VERIFY and DRAFT_EXTEND of k + 1 >= 2 (extend rows of a constant length)."""
    assert mode in CAPTURED_MODES, f"no graphs for {mode.name}"
    assert (mode in SINGLE_TOKEN_MODES) == (tokens_per_row == 1), (mode.name, tokens_per_row)


def replay_tokens_per_row(batch: ForwardBatch) -> int:
    """The query tokens of every row of a graph runner's static batch (its capture
    key's), after the batch's shape checks: a captured mode with uniform rows."""
    batch.check()
    bs, t = batch.batch_size, batch.q_lens_cpu[0]
    check_capture(batch.mode, t)
    assert batch.q_lens_cpu.count(t) == bs and batch.num_tokens == bs * t, "uniform rows"
    return t


class AttentionBackend(ABC):
    name: str
    # A backend that supports CUDA graphs keeps the metadata of each captured mode
    # (DECODE: one token per row; VERIFY: k + 1 per row) in static buffers
    # (capture_buffers) and rebuilds it in place before every replay
    # (prepare_replay), from the graph runner's static batch.
    supports_cuda_graph: bool = False
    # Whether `prepare_replay` must run before every replay because it writes what the
    # captured kernels read (flashinfer's planner fills its buffers). False where it
    # only returns views of the static batch (triton): a CUDA-graph replay then skips
    # it (worker/cuda_graph.py; ~50 us of a ~1 ms step's host time on an H200's host).
    replay_plans: bool = True
    # Whether every row attends over the lengths in the device tensor `batch.seq_lens`,
    # the host lengths only bounding the work: then a draft step's lengths may live on
    # the device alone (`forward.metadata.advanced_rows`), and a verify row may start
    # where the device says (floating rows, `forward.metadata.shift_rows`).
    device_lengths: bool = False
    # Whether `prepare_any_rows` serves: one graph over batches of any rows (a token
    # count's piecewise pass captured whole: worker/piecewise_graph.py)
    supports_any_rows_graph: bool = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale

    @abstractmethod
    def build_metadata(self, batch: ForwardBatch) -> Any:
        """Compute this step's attention metadata from the batch (once per step)."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """Write k, v of the new tokens into the cache and attend (a caller that wrote
        them itself, e.g. fused with rotary, calls `attend`).

        q: [T, H, D]; k, v: [T, KVH, D] -> [T, H * D]
        """
        assert k.shape == v.shape == (q.shape[0], self.num_kv_heads, self.head_dim), k.shape
        batch.kv_cache.write(layer, batch.out_cache_loc, k, v)
        return self.attend(q, layer, batch)

    @abstractmethod
    def attend(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        """Attention of q [T, H, D] over the layer's cache, the new tokens' K/V already
        in it -> [T, H * D]."""

    def fuses_rope(self, batch: ForwardBatch) -> bool:
        """Whether `attend_rope` serves this batch (RoPE and the K/V write inside the
        attention kernel: one launch less per layer)."""
        return False

    def attend_rope(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        layer: int,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """`attend` from unrotated q, k (rotate-half RoPE with the float32 cos | sin
        table `cos_sin` [max_pos, D]); writes the rotated k and v into the cache.
        Only where `fuses_rope(batch)`."""
        raise NotImplementedError(f"{self.name} does not fuse RoPE")

    def capture_buffers(
        self,
        max_bs: int,
        max_pages: int,
        device: torch.device,
        mode: ForwardMode = ForwardMode.DECODE,
        tokens_per_row: int = 1,
    ) -> None:
        """Allocate static metadata for graphs of `mode` (batches up to max_bs rows of
        `tokens_per_row` query tokens each, page tables up to max_pages wide)."""
        raise NotImplementedError(f"{self.name} does not support CUDA graphs")

    def warm_up_kernels(
        self,
        kv_cache: KVCache,
        dtype: torch.dtype,
        max_rows: int,
        page_size: int,
        eager_decode_rows: range = range(0),
    ) -> None:
        """Build, before serving, the kernel variants the eager steps of batches up to
        max_rows rows, and eager DECODE batches of `eager_decode_rows` rows (those no
        graph holds), may need beyond those the warm-up steps met (nothing by default)."""
        return None  # NOTE: backends with nothing to build keep this

    def any_rows_fit(self, batch: ForwardBatch) -> bool:
        """Whether a graph of `prepare_any_rows` may serve this (real) batch as well as
        its eager metadata would (host values only)."""
        return False

    def prepare_any_rows(self, batch: ForwardBatch, decode_lens: torch.Tensor) -> Any:
        """Metadata that views a static batch of R rows (spare rows of q_len 0, tokens no
        row covers) for a graph captured once and replayed for any rows of at most its
        tokens: every launch's grid depends on the token count and R alone.
        decode_lens: [min(R, T)] the decode rows' KV lengths (the first rows), 0 for
        every other row (whose q_lens then hold their work; a decode row's is 0)."""
        raise NotImplementedError(f"{self.name} has no graphs over any rows")

    def prepare_replay(self, batch: ForwardBatch) -> Any:
        """Metadata in the static buffers for the graph runner's static `batch` of a
        captured mode (capture and every replay); dispatches on `batch.mode`."""
        raise NotImplementedError(f"{self.name} does not support CUDA graphs")
