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

Whole graphs: where the attention backend can attend over any rows inside a graph
(`AttentionBackend.supports_any_rows_graph`: the Triton decode kernel over the decode
rows, then the extend kernel's flat grid over the rest), each size is also captured as
ONE graph, attention included, over static row buffers (lengths, query starts and
counts, the decode rows' lengths, page table) of up to max_rows rows: a step copies its
rows in (spare rows get q_len 0, rows other than decode rows decode length 0) and
replays once. A step the backend cannot serve so (`any_rows_fit`: verify rows) runs the
pieces. The whole pass's padding tokens belong to no row: their attention output is
zero.
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
from gyrfalcon.forward.metadata import BatchTensors, aligned_len
from gyrfalcon.ipc.contract import DUMMY_PAGE
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.base import AttentionBackend
from gyrfalcon.worker.cuda_graph import capture_stream, padded_batch_size

logger = logging.getLogger(__name__)

# what a forward returns (the executor's: final hidden states, then the aux states)
Forward = Callable[[ForwardBatch], tuple[torch.Tensor, ...]]


def fill_static_rows(
    rows: torch.Tensor, table: torch.Tensor, bt: BatchTensors, num_decode: int
) -> None:
    """Write bt's rows into a whole graph's static row buffers (rows [4, R]: seq_lens,
    q_lens, q_starts, decode lengths; table [R, max_pages]): its first num_decode rows
    as decode rows (their lengths in row 3, q_len 0), the rest as extend rows (decode
    length 0); the rows after them get q_len 0 and decode length 0 (no work)."""
    bs, width, nd = len(bt.seq_lens_cpu), bt.page_table.shape[1], num_decode
    assert bt.row_lens is not None, "a step's rows, from build_batch_tensors"
    assert rows.shape[0] == 4 and 0 <= nd <= bs <= rows.shape[1], (rows.shape, nd, bs)
    rows[:3, :bs].copy_(bt.row_lens)
    rows[3, :nd].copy_(rows[0, :nd])
    rows[3, nd:].zero_()
    rows[1, :nd].zero_()
    rows[1, bs:].zero_()
    table[:bs, :width].copy_(bt.page_table)


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
        max_rows: int = 0,
        max_pages: int = 0,
    ):
        """forward: the model's forward over a batch -> per-token outputs; like: the
        backend the steps attend with (this rank's heads). max_rows, max_pages: the
        whole graphs' row capacity and page-table width (0: pieces only)."""
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
        # whole graphs (module docstring): static rows [4, R] (seq_lens, q_lens, q_starts,
        # the decode rows' lengths; R even: each row 16-byte aligned) and page table
        # [R, max_pages]
        self.like = like
        self.whole = like.supports_any_rows_graph and max_rows > 0 and max_pages > 0
        r = aligned_len(max(max_rows, 1))
        self.rows = torch.zeros(4, r if self.whole else 0, dtype=torch.int64, device=device)
        self.rows[0] = 1
        self.table = torch.full(
            (r, max_pages) if self.whole else (0, 0), DUMMY_PAGE, dtype=torch.int64, device=device
        )
        self.whole_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.whole_outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        self.num_whole_runs = 0
        self.last_whole = False  # whether the last `run` replayed a whole graph
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

    def _whole_batch(self, size: int) -> ForwardBatch:
        """A whole pass's batch: the static token and row buffers (R rows, host lengths
        at their bound), the real backend attending on the flat grid."""
        r, cap = self.rows.shape[1], self.table.shape[1] * self.page_size
        batch = ForwardBatch(
            mode=ForwardMode.MIXED, input_ids=self.tokens[0, :size],
            positions=self.tokens[1, :size], out_cache_loc=self.tokens[2, :size],
            seq_lens=self.rows[0], q_lens=self.rows[1], q_starts=self.rows[2],
            page_table=self.table, seq_lens_cpu=[cap] * r, q_lens_cpu=[1] * r,
            page_size=self.page_size, kv_cache=self.kv_cache, attn_backend=self.like,
            num_decode_rows=0,
        )  # fmt: skip
        batch.attn_meta = self.like.prepare_any_rows(batch, self.rows[3, : min(r, size)])
        return batch

    def _fill_rows(self, bt: BatchTensors, num_decode: int) -> None:
        fill_static_rows(self.rows, self.table, bt, num_decode)

    def _fits_whole(self, real: ForwardBatch) -> bool:
        # NOTE: capture() made a whole graph of every size (cuda mode)
        return (
            self.whole
            and real.batch_size <= self.rows.shape[1]
            and real.attn_backend.any_rows_fit(real)
        )

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
        if self.whole and self.mode == "cuda":  # NOTE: every row spare: the kernel builds
            self.rows[1].zero_()
            for size in reversed(self.sizes):
                self._fill(None, size)
                self.forward(self._whole_batch(size))
        if self.mode == "cuda":
            gc.collect()
            gc.disable()  # NOTE: as GraphRunner.capture: no collection mid-capture
            try:
                self._capture_all()
                if self.whole:
                    self._capture_whole()
            finally:
                gc.enable()
        logger.info(
            "piecewise graphs for %d sizes up to %d tokens (%d pieces each%s) in %.1f s",
            len(self.sizes), self.sizes[-1], len(self.layers) + 1,
            f", and whole over up to {self.rows.shape[1]} rows" if self.whole else "",
            time.perf_counter() - t0,
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

    def _capture_whole(self) -> None:
        """One graph per size, attention included, into the pieces' memory pool."""
        stream = capture_stream(self.device)
        for size in reversed(self.sizes):  # NOTE: every row spare since the warm passes
            self._fill(None, size)
            batch = self._whole_batch(size)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(stream):
                graph.capture_begin(pool=self._pool)
                try:
                    self.whole_outputs[size] = self.forward(batch)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            self.whole_graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def run(
        self,
        mode: ForwardMode,
        bt: BatchTensors,
        backend: AttentionBackend,
        size: int | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """The forward of bt (`can_run`) attending with `backend` -> each output's rows of
        bt's tokens (views of static buffers: valid until the next run): one whole graph
        where it fits (module docstring), else the pieces; padded to `size` (a captured
        one: what the DP ranks agreed on), else to the smallest that holds bt."""
        t = bt.input_ids.shape[0]
        if size is None:
            size = padded_batch_size(t, self.sizes, "token count")
        assert size in self.sizes and 0 < t <= size, (
            f"a {mode.name} batch of {t} tokens padded to {size}: not a captured size "
            f"holding it ({self.sizes}; DP ranks: the plan's `graph_tokens`)"
        )
        n = self._fill(bt, size)
        real = ForwardBatch.from_tensors(mode, bt, self.page_size, self.kv_cache, backend)
        self.num_runs += 1
        self.last_whole = self._fits_whole(real)
        if self.last_whole:
            real.check()  # NOTE: the host checks of its eager metadata (none is built)
            self._fill_rows(bt, real.num_decode_rows)
            self.num_whole_runs += 1
            if self.mode == "cuda":
                self.whole_graphs[size].replay()
                out = self.whole_outputs[size]
            else:
                out = self.forward(self._whole_batch(size))
            return tuple(x[:n] for x in out)
        real.attn_meta = backend.build_metadata(real)
        self._real, self._num_tokens = real, n
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
