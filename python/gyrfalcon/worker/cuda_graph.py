"""CUDA graphs for decode: static buffers, capture sizes, padding, replay.

A decode batch of `bs` rows runs in the graph captured for the smallest
capture size >= bs. The extra rows are padding: token 0 at position 0,
writing and reading only the reserved dummy page, with sequence length 1, so
every length stays >= 1 and no KV capacity beyond that page is needed.

Capture and replay feed the model the same way: `StaticBuffers.fill` writes a
batch (real rows + padding) into the static buffers, and the backend's
`prepare_replay` builds its metadata from them. Capture uses a batch of only
padding rows; replay a real one.

On CPU (or with mode "static"), the same function runs eagerly on the static
buffers at the padded size instead of replaying a graph, so CI covers the
padding and index paths without a GPU.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import BatchTensors
from gyrfalcon.ipc.contract import DUMMY_PAGE
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.base import AttentionBackend

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int, explicit: list[int] | None = None) -> list[int]:
    """Sizes to capture, ascending: 1, 2, 4, 8, then every 8 up to max_bs (max_bs included)."""
    if explicit:
        sizes = sorted({s for s in explicit if 1 <= s <= max_bs} | {max_bs})
        return sizes
    sizes = [s for s in (1, 2, 4) if s < max_bs]
    sizes += list(range(8, max_bs, 8))
    return sorted(set(sizes) | {max_bs})


def padded_batch_size(bs: int, sizes: list[int]) -> int:
    """Smallest capture size >= bs (sizes ascending)."""
    for s in sizes:
        if s >= bs:
            return s
    raise ValueError(f"batch size {bs} exceeds the largest capture size {sizes[-1]}")


@dataclass
class StaticBuffers:
    """Inputs of a captured decode step; rows [0, max_bs)."""

    # [3, max_bs] int64: rows input_ids, positions, out_cache_loc (one block, so `fill`
    # writes all three with one copy from the step's upload, where they are consecutive)
    tokens: torch.Tensor
    seq_lens: torch.Tensor  # [max_bs] int64
    q_lens: torch.Tensor  # [max_bs] int64, all ones (one token per row)
    q_starts: torch.Tensor  # [max_bs] int64, arange (row i's token is token i)
    page_table: torch.Tensor  # [max_bs, max_pages] int64

    @classmethod
    def allocate(cls, max_bs: int, max_pages: int, device: torch.device) -> StaticBuffers:
        def z(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        return cls(
            tokens=z(3, max_bs),
            seq_lens=torch.ones(max_bs, dtype=torch.int64, device=device),
            q_lens=torch.ones(max_bs, dtype=torch.int64, device=device),
            q_starts=torch.arange(max_bs, dtype=torch.int64, device=device),
            page_table=z(max_bs, max_pages),
        )

    @property
    def input_ids(self) -> torch.Tensor:
        return self.tokens[0]

    @property
    def positions(self) -> torch.Tensor:
        return self.tokens[1]

    @property
    def out_cache_loc(self) -> torch.Tensor:
        return self.tokens[2]

    @property
    def max_bs(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def max_pages(self) -> int:
        return int(self.page_table.shape[1])

    def fill(self, bt: BatchTensors | None, padded_bs: int) -> list[int]:
        """Write real rows of `bt` and padding rows up to padded_bs; returns seq lens.

        NOTE: padding rows use the dummy page (slot DUMMY_PAGE * page_size == 0
        since DUMMY_PAGE is 0), position 0 and sequence length 1.
        """
        bs = 0 if bt is None else len(bt.seq_lens_cpu)
        assert bs <= padded_bs <= self.max_bs, (bs, padded_bs, self.max_bs)
        if bt is not None and bs:
            assert bt.input_ids.shape[0] == bs, "decode rows carry exactly one token"
            width = bt.page_table.shape[1]
            assert width <= self.max_pages, f"page table width {width} > {self.max_pages}"
            self.tokens[:, :bs].copy_(bt.token_rows)
            self.seq_lens[:bs].copy_(bt.seq_lens)
            self.page_table[:bs, :width].copy_(bt.page_table)
        if padded_bs > bs:  # NOTE: no launches (and no host time) when nothing is padded
            pad = slice(bs, padded_bs)
            self.input_ids[pad] = 0
            self.positions[pad] = 0
            self.out_cache_loc[pad] = DUMMY_PAGE
            self.seq_lens[pad] = 1
            self.page_table[pad] = DUMMY_PAGE
        seq_lens = [] if bt is None else list(bt.seq_lens_cpu)
        return seq_lens + [1] * (padded_bs - bs)

    def forward_batch(
        self,
        padded_bs: int,
        seq_lens: list[int],
        page_size: int,
        kv_cache: KVCache,
        backend: AttentionBackend,
    ) -> ForwardBatch:
        """The decode batch of rows [0, padded_bs): views of these buffers (`fill` first)."""
        return ForwardBatch(
            mode=ForwardMode.DECODE,
            input_ids=self.input_ids[:padded_bs],
            positions=self.positions[:padded_bs],
            out_cache_loc=self.out_cache_loc[:padded_bs],
            seq_lens=self.seq_lens[:padded_bs],
            q_lens=self.q_lens[:padded_bs],
            q_starts=self.q_starts[:padded_bs],
            page_table=self.page_table[:padded_bs],
            seq_lens_cpu=seq_lens,
            q_lens_cpu=[1] * padded_bs,
            page_size=page_size,
            kv_cache=kv_cache,
            attn_backend=backend,
        )


class GraphRunner:
    """Decode through captured CUDA graphs (mode "cuda") or static-buffer replay ("static")."""

    def __init__(
        self,
        forward: Callable[[ForwardBatch], tuple[torch.Tensor, ...]],
        backend: AttentionBackend,
        kv_cache: KVCache,
        page_size: int,
        max_bs: int,
        max_pages: int,
        device: torch.device,
        mode: str,
        sizes: list[int] | None = None,
    ):
        assert mode in ("cuda", "static"), mode
        if mode == "cuda":
            assert device.type == "cuda", "CUDA graphs need a CUDA device"
            assert backend.supports_cuda_graph, f"{backend.name} cannot be captured"
        self.forward, self.backend, self.kv_cache = forward, backend, kv_cache
        self.page_size, self.device, self.mode = page_size, device, mode
        self.sizes = capture_batch_sizes(max_bs, sizes)
        self.buf = StaticBuffers.allocate(self.sizes[-1], max_pages, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.num_runs = 0  # decode steps served through the graph runner
        if backend.supports_cuda_graph:
            backend.capture_buffers(self.sizes[-1], max_pages, device)

    def can_run(self, mode: ForwardMode, bt: BatchTensors) -> bool:
        return (
            mode == ForwardMode.DECODE
            and len(bt.seq_lens_cpu) <= self.sizes[-1]
            and bt.page_table.shape[1] <= self.buf.max_pages
        )

    def _batch(self, padded_bs: int, seq_lens: list[int]) -> ForwardBatch:
        return self.buf.forward_batch(
            padded_bs, seq_lens, self.page_size, self.kv_cache, self.backend
        )

    def _metadata(self, batch: ForwardBatch) -> None:
        if self.backend.supports_cuda_graph:
            batch.attn_meta = self.backend.prepare_replay(batch)
        else:
            batch.attn_meta = self.backend.build_metadata(batch)

    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool.

        In static mode each size runs once eagerly on capture inputs instead, so
        CPU tests exercise exactly what a capture feeds the model.
        """
        if self.mode == "static":
            for bs in reversed(self.sizes):
                batch = self._batch(bs, self.buf.fill(None, bs))
                self._metadata(batch)
                self.forward(batch)
            return
        # NOTE: a garbage collection during capture can free pinned host memory or
        # destroy CUDA events of dead objects, which invalidates the capture: collect
        # first, then keep the collector off until every size is captured.
        gc.collect()
        gc.disable()
        try:
            self._capture_all()
        finally:
            gc.enable()

    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        pool = None
        stream = torch.cuda.Stream(self.device)
        for bs in tqdm(list(reversed(self.sizes)), desc="Capturing CUDA graphs", unit="graph"):
            seq_lens = self.buf.fill(None, bs)
            batch = self._batch(bs, seq_lens)
            self._metadata(batch)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: lazy inits and autotuning outside the graph
                    self.forward(batch)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[bs] = self.forward(batch)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d CUDA graphs (batch sizes %s) in %.1f s",
            len(self.sizes),
            self.sizes,
            time.perf_counter() - t0,
        )

    def run(self, bt: BatchTensors) -> tuple[torch.Tensor, ...]:
        """Outputs of the real rows: each of forward(...)'s tensors [:bs]."""
        bs = len(bt.seq_lens_cpu)
        padded = padded_batch_size(bs, self.sizes)
        seq_lens = self.buf.fill(bt, padded)
        batch = self._batch(padded, seq_lens)
        self._metadata(batch)
        self.num_runs += 1
        if self.mode == "cuda":
            self.graphs[padded].replay()
            out = self.outputs[padded]
        else:
            out = self.forward(batch)
        return tuple(t[:bs] for t in out)
