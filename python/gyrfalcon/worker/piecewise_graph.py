"""Piecewise CUDA graphs: the target's eager forwards (prefill chunks, mixed steps)
as graphs of everything between two attention calls, keyed by padded token count.

A forward that no full graph serves (a prefill chunk, a prompt beside decoding or
verifying rows) launches every kernel from Python: ~250 launches for a 30-layer
model, ~10-20 ms of host time whatever the batch, which every arriving request
costs the whole batch (benchmarks/NOTES.md). Attention is the one part whose launch
depends on the batch's rows (its metadata, its host lengths); everything else only
on the token count T. So a forward of T <= the largest size runs padded to the
smallest captured size Tp >= T as:

    piece 0 (embedding .. layer 0's qkv projection, rotary and KV write)
    attention of layer 0, eager, on the real T tokens
    piece 1 (layer 0's o_proj, MLP .. layer 1's qkv ...), attention of layer 1, ...
    piece N (the last layer's MLP, the final norm, the aux states)

Each piece ends by copying its query (and, where the backend writes the cache itself,
key and value) rows into one staging buffer; the eager attention reads the first T
rows of it and writes its output into one output buffer, which the next piece reads
(both shared by every layer and size: the pieces run in order). Padding tokens are
token 0 at position 0 writing the reserved dummy page's first slot; their attention
output rows hold whatever the buffer held (finite), and no real row reads them.

Capture: one eager pass per size first (kernels compile outside the capture), then
one pass with an attention stand-in (`_Split`) that ends the current graph at each
attention call and begins the next, all in one memory pool. On the CPU (or with
mode "static") the same pass runs eagerly on the static buffers at the padded size,
the stand-in running the real attention at once: CI covers the padding, the staging
and the output buffer.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import BatchTensors
from gyrfalcon.ipc.contract import DUMMY_PAGE
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.base import AttentionBackend
from gyrfalcon.worker.cuda_graph import capture_stream, padded_batch_size

logger = logging.getLogger(__name__)

# what a forward returns (the executor's: final hidden states, then the aux states)
Forward = Callable[[ForwardBatch], tuple[torch.Tensor, ...]]


def piecewise_sizes(max_tokens: int) -> list[int]:
    """Padded token counts to capture, ascending: 16, 32, 64, then steps of half the
    previous power of two (96, 128, 192, 256, 384, 512, ...; at most 1.5x padding
    above 64 tokens), up to max_tokens (included); [] when max_tokens < 1."""
    if max_tokens < 1:
        return []
    sizes, size = [], 16
    while size < max_tokens:
        sizes.append(size)
        half = 1 << (size.bit_length() - 2)  # NOTE: half the power of two <= size
        size = size * 2 if size < 64 else size + half
    return sorted(set(sizes) | {max_tokens})


class _Split(AttentionBackend):
    """The attention of a piecewise pass: stage q (k, v), then hand over to the runner
    (`PiecewiseGraphs._boundary`), return the output buffer's rows."""

    name = "piecewise"

    def __init__(self, runner: PiecewiseGraphs, like: AttentionBackend):
        super().__init__(like.num_heads, like.num_kv_heads, like.head_dim, like.scale)
        self.runner = runner

    def build_metadata(self, batch: ForwardBatch) -> Any:
        return None

    def forward(self, q, k, v, layer, batch) -> torch.Tensor:
        return self.runner._boundary(layer, q, k, v)

    def attend(self, q, layer, batch) -> torch.Tensor:
        return self.runner._boundary(layer, q, None, None)


class PiecewiseGraphs:
    """The target's eager-path forwards through piecewise graphs (module docstring)."""

    def __init__(
        self,
        forward: Forward,
        like: AttentionBackend,
        kv_cache: KVCache,
        dtype: torch.dtype,
        page_size: int,
        device: torch.device,
        mode: str,
        sizes: list[int],
    ):
        """forward: the model's forward over a batch -> per-token outputs; like: a
        backend with the model's head shape (this rank's heads)."""
        assert mode in ("cuda", "static") and sizes, (mode, sizes)
        self.forward, self.kv_cache, self.page_size = forward, kv_cache, page_size
        self.device, self.mode, self.sizes = device, mode, sizes
        h, kvh, d = like.num_heads, like.num_kv_heads, like.head_dim
        self.q_cols, self.kv_cols = h * d, kvh * d
        t = sizes[-1]
        # [3, t] int64 rows: input ids, positions, KV slots (one copy from a step's upload)
        self.tokens = torch.zeros(3, t, dtype=torch.int64, device=device)
        self.pad = torch.zeros(3, t, dtype=torch.int64, device=device)
        self.pad[2] = DUMMY_PAGE * page_size  # NOTE: padding writes the dummy page only
        self.stage = torch.zeros(t, self.q_cols + 2 * self.kv_cols, dtype=dtype, device=device)
        self.out = torch.zeros(t, self.q_cols, dtype=dtype, device=device)
        self.split = _Split(self, like)
        self.layers: list[tuple[int, bool]] = []  # (layer, stages k and v) per attention call
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.num_runs = 0
        # the pass in progress: "warm" (no attention), "capture", or "run" (static mode:
        # attention at once, for `_real` and its `_num_tokens`)
        self._phase = "warm"
        self._pieces: list[torch.cuda.CUDAGraph] = []
        self._pool: Any = None
        self._calls: list[tuple[int, bool]] = []
        self._real: ForwardBatch | None = None
        self._num_tokens = 0

    def can_run(self, bt: BatchTensors) -> bool:
        return 0 < bt.input_ids.shape[0] <= self.sizes[-1]

    # ------------------------------------------------------------ one pass

    def _static_batch(self, size: int) -> ForwardBatch:
        """The pass's batch: views of the static token rows; no row metadata (the pieces
        read none; the eager attention reads the real batch's)."""
        one = self.tokens[0, :1]
        return ForwardBatch(
            mode=ForwardMode.PREFILL, input_ids=self.tokens[0, :size],
            positions=self.tokens[1, :size], out_cache_loc=self.tokens[2, :size],
            seq_lens=one, q_lens=one, q_starts=one, page_table=one.view(1, 1),
            seq_lens_cpu=[size], q_lens_cpu=[size], page_size=self.page_size,
            kv_cache=self.kv_cache, attn_backend=self.split, num_decode_rows=0,
        )  # fmt: skip

    def _fill(self, bt: BatchTensors | None, size: int) -> int:
        """Write bt's token rows and padding up to size; returns bt's token count."""
        n = 0 if bt is None else bt.input_ids.shape[0]
        if n:
            self.tokens[:, :n].copy_(bt.token_rows)
        self.tokens[:, n:size].copy_(self.pad[:, : size - n])
        return n

    def _boundary(
        self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        """An attention call of the pass: stage its inputs, then attend now (static), end
        this piece and begin the next (capture), or skip (warm); -> the output rows."""
        size = q.shape[0]
        stage = self.stage[:size]
        stage[:, : self.q_cols].copy_(q.reshape(size, -1))
        if k is not None and v is not None:
            stage[:, self.q_cols : self.q_cols + self.kv_cols].copy_(k.reshape(size, -1))
            stage[:, self.q_cols + self.kv_cols :].copy_(v.reshape(size, -1))
        self._calls.append((layer, k is not None))
        if self._phase == "capture":
            self._pieces[-1].capture_end()
            self._begin_piece()
        elif self._phase == "run":
            self._attend(len(self._calls) - 1)
        return self.out[:size]

    def _attend(self, i: int) -> None:
        """Attention call i of the pass for the real batch: staged rows -> output rows."""
        real, n = self._real, self._num_tokens
        assert real is not None
        layer, has_kv = self.layers[i] if self.layers else self._calls[i]
        backend, sp = real.attn_backend, self.split
        q = self.stage[:n, : self.q_cols].view(n, sp.num_heads, sp.head_dim)
        if has_kv:
            kv = self.stage[:n, self.q_cols :].view(n, 2, sp.num_kv_heads, sp.head_dim)
            out = backend.forward(q, kv[:, 0], kv[:, 1], layer, real)
        else:
            out = backend.attend(q, layer, real)
        self.out[:n].copy_(out)

    def _begin_piece(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)
        self._pieces.append(graph)

    def _pass(self, phase: str, size: int) -> tuple[torch.Tensor, ...]:
        self._phase, self._calls = phase, []
        out = self.forward(self._static_batch(size))
        if not self.layers:
            self.layers = list(self._calls)
        assert self._calls == self.layers, "every pass makes the same attention calls"
        return out

    # ------------------------------------------------------------ capture, run

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size, largest first, into one memory pool (mode "cuda"); in
        static mode one eager pass per size instead."""
        t0 = time.perf_counter()
        for size in reversed(self.sizes):
            self._fill(None, size)
            self._pass("warm", size)
        if self.mode == "cuda":
            gc.collect()
            gc.disable()  # NOTE: as GraphRunner.capture: no collection mid-capture
            try:
                self._capture_all()
            finally:
                gc.enable()
        logger.info(
            "piecewise graphs for %d sizes up to %d tokens (%d pieces each) in %.1f s",
            len(self.sizes), self.sizes[-1], len(self.layers) + 1, time.perf_counter() - t0,
        )  # fmt: skip

    def _capture_all(self) -> None:
        stream = capture_stream(self.device)
        self._pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            self._fill(None, size)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._pieces = []
                self._begin_piece()
                self.outputs[size] = self._pass("capture", size)
                self._pieces[-1].capture_end()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.graphs[size], self._pieces = self._pieces, []
        torch.cuda.synchronize(self.device)

    def run(
        self, mode: ForwardMode, bt: BatchTensors, backend: AttentionBackend
    ) -> tuple[torch.Tensor, ...]:
        """The forward of bt (`can_run`) attending with `backend` -> each output's rows of
        bt's tokens (views of static buffers: valid until the next run)."""
        size = padded_batch_size(bt.input_ids.shape[0], self.sizes, "token count")
        n = self._fill(bt, size)
        real = ForwardBatch.from_tensors(mode, bt, self.page_size, self.kv_cache, backend)
        real.attn_meta = backend.build_metadata(real)
        self._real, self._num_tokens = real, n
        self.num_runs += 1
        try:
            if self.mode == "cuda":
                pieces = self.graphs[size]
                for i, graph in enumerate(pieces):
                    graph.replay()
                    if i < len(self.layers):
                        self._attend(i)
                out = self.outputs[size]
            else:
                out = self._pass("run", size)
        finally:
            self._real = None
        return tuple(x[:n] for x in out)
