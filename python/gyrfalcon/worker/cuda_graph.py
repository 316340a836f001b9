"""CUDA graphs for any forward mode: capture keys, static buffers, padding, replay.

A graph is keyed by a small descriptor, `GraphKey(mode, batch_size, tokens_per_row,
variant)`: DECODE graphs have one query token per row, VERIFY graphs k + 1 (the last
accepted token and k drafts); a variant names another callable of the same mode
(the whole greedy spec step, worker/spec_step_graph.py). A batch of `bs` rows runs
in the graph of its mode captured for the smallest capture size >= bs. The extra
rows are padding: token 0 at positions 0 .. t - 1 (t = tokens per row) with
sequence length t, writing and
reading only the reserved dummy page, so every length stays >= 1 (also after a
per-token shift of up to t - 1) and no KV capacity beyond that page is needed.
A padded row of t > page_size tokens references the dummy page ceil(t /
page_size) times in its page-table row (asserted to fit).

Capture and replay feed the model the same way: `StaticBuffers.fill`
(worker/static_buffers.py) writes a
batch (real rows + padding) into the static buffers, and the backend's
`prepare_replay` builds its metadata from them. Capture uses a batch of only
padding rows; replay a real one. Each mode has its own captured callable and
its own backend instance (`GraphSpec`); every captured callable returns
per-token outputs, so the real rows' outputs are the first bs * t of each.

On CPU (or with mode "static"), the same function runs eagerly on the static
buffers at the padded size instead of replaying a graph, so CI covers the
padding and index paths without a GPU.
"""

from __future__ import annotations

import functools
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
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.base import CAPTURED_MODES, AttentionBackend
from gyrfalcon.worker.static_buffers import GraphKey, StaticBuffers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphSpec:
    """One captured mode: its callable (a static batch -> per-token outputs, e.g.
    (logits [T, vocab], argmax [T])), its backend instance and tokens per row.
    `inner`: the other (backend, mode) pairs its callable attends with (the fused
    spec step's drafter round), whose replay buffers the runner sets up too."""

    mode: ForwardMode
    tokens_per_row: int
    forward: Callable[[ForwardBatch], tuple[torch.Tensor, ...]]
    backend: AttentionBackend
    variant: str = ""
    inner: tuple[tuple[AttentionBackend, ForwardMode], ...] = ()

    @property
    def name(self) -> tuple[ForwardMode, str]:
        return self.mode, self.variant


@functools.cache
def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream every capture on `device` runs on. NOTE: torch keeps a cuBLAS
    workspace for every stream that ran a matmul, for good; a new stream per capture
    would leave one more behind each time the graphs are captured again."""
    return torch.cuda.Stream(device)


def capture_batch_sizes(max_bs: int, explicit: list[int] | None = None) -> list[int]:
    """Sizes to capture, ascending: 1, 2, 4, 8, then every 8 up to max_bs (max_bs included)."""
    if explicit:
        sizes = sorted({s for s in explicit if 1 <= s <= max_bs} | {max_bs})
        return sizes
    sizes = [s for s in (1, 2, 4) if s < max_bs]
    sizes += list(range(8, max_bs, 8))
    return sorted(set(sizes) | {max_bs})


def padded_batch_size(bs: int, sizes: list[int], what: str = "batch size") -> int:
    """Smallest capture size >= bs (sizes ascending): rows of a graph batch, or tokens
    of a piecewise pass (what names them in the error)."""
    for s in sizes:
        if s >= bs:
            return s
    raise ValueError(f"{what} {bs} exceeds the largest capture size {sizes[-1]}")


def graph_keys(specs: list[GraphSpec], sizes: list[int]) -> list[GraphKey]:
    """Every key to capture, in capture order: most tokens first (so the shared memory
    pool is sized by the largest graph), then by mode and size."""
    keys = [GraphKey(s.mode, bs, s.tokens_per_row, s.variant) for s in specs for bs in sizes]
    return sorted(keys, key=lambda k: (-k.num_tokens, k.mode, k.variant, -k.batch_size))


class GraphRunner:
    """Steps of the captured modes through CUDA graphs (mode "cuda") or static-buffer
    replay ("static")."""

    def __init__(
        self,
        specs: list[GraphSpec],
        kv_cache: KVCache,
        page_size: int,
        max_bs: int,
        max_pages: int,
        device: torch.device,
        mode: str,
        sizes: list[int] | None = None,
    ):
        assert mode in ("cuda", "static"), mode
        assert specs and len({s.name for s in specs}) == len(specs), "one spec per mode, variant"
        for spec in specs:
            assert spec.mode in CAPTURED_MODES, f"no graphs for {spec.mode.name}"
            if mode == "cuda":
                assert spec.backend.supports_cuda_graph, f"{spec.backend.name} cannot be captured"
        if mode == "cuda":
            assert device.type == "cuda", "CUDA graphs need a CUDA device"
        self.specs = {s.name: s for s in specs}
        self.kv_cache, self.device, self.mode = kv_cache, device, mode
        self.sizes = capture_batch_sizes(max_bs, sizes)
        self.keys = graph_keys(specs, self.sizes)
        tokens_per_row = tuple(sorted({s.tokens_per_row for s in specs}))
        self.buf = StaticBuffers.allocate(
            self.sizes[-1], max_pages, page_size, device, tokens_per_row
        )
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, tuple[torch.Tensor, ...]] = {}
        # (key, tokens) -> the outputs' first rows (`_real_rows`): at most max_bs entries
        # per captured mode
        self._views: dict[tuple[GraphKey, int], tuple[torch.Tensor, ...]] = {}
        self.num_runs = 0  # steps served through the graph runner, every mode
        for s in specs:
            for backend, m in ((s.backend, s.mode), *s.inner):
                if backend.supports_cuda_graph:  # NOTE: flashinfer: per mode; triton: shared
                    backend.capture_buffers(self.sizes[-1], max_pages, device, m, s.tokens_per_row)

    def largest(self, mode: ForwardMode) -> int:
        """The most rows a graph of `mode` serves (0: none of that mode)."""
        return self.sizes[-1] if any(m == mode for m, _ in self.specs) else 0

    def can_run(
        self, mode: ForwardMode, bt: BatchTensors, variant: str = "", rows: int = 0
    ) -> bool:
        """Whether a graph serves bt (padded to at least `rows` rows)."""
        spec = self.specs.get((mode, variant))
        if spec is None:
            return False
        bs, t = len(bt.seq_lens_cpu), spec.tokens_per_row
        # NOTE: one comparison serves decode (every q_len >= 1, so T == bs means all 1)
        return (
            max(bs, rows) <= self.sizes[-1]
            and bt.page_table.shape[1] <= self.buf.max_pages
            and bt.input_ids.shape[0] == bs * t
            and (t == 1 or bt.q_lens_cpu.count(t) == bs)
        )

    def _prepare(self, key: GraphKey, seq_lens: list[int]) -> ForwardBatch:
        """The key's static batch with its attention metadata (after `fill`)."""
        backend = self.specs[key.mode, key.variant].backend
        batch = self.buf.forward_batch(key, seq_lens, self.kv_cache, backend)
        if backend.supports_cuda_graph:
            batch.attn_meta = backend.prepare_replay(batch)
        else:
            batch.attn_meta = backend.build_metadata(batch)
        return batch

    @torch.inference_mode()  # NOTE: as every replay runs (a TP all-gather writes views)
    def capture(self) -> None:
        """Capture every key, most tokens first, into one memory pool.

        In static mode each key runs once eagerly on capture inputs instead, so CPU
        tests exercise exactly what a capture feeds the model.
        """
        if self.mode == "static":
            for key in self.keys:
                spec = self.specs[key.mode, key.variant]
                spec.forward(self._prepare(key, self.buf.fill(None, key)))
            return
        # NOTE: a garbage collection during capture can free pinned host memory or
        # destroy CUDA events of dead objects, which invalidates the capture: collect
        # first, then keep the collector off until every key is captured.
        gc.collect()
        gc.disable()
        try:
            self._capture_all()
        finally:
            gc.enable()

    def _capture_all(self) -> None:
        t0 = time.perf_counter()
        pool = None
        stream = capture_stream(self.device)
        self._views.clear()  # NOTE: views of the outputs of an earlier capture
        for key in tqdm(self.keys, desc="Capturing CUDA graphs", unit="graph"):
            forward = self.specs[key.mode, key.variant].forward
            batch = self._prepare(key, self.buf.fill(None, key))
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: lazy inits and autotuning outside the graph
                    forward(batch)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.outputs[key] = forward(batch)
            pool = graph.pool()
            self.graphs[key] = graph
        torch.cuda.synchronize(self.device)
        logger.info(
            "captured %d CUDA graphs (batch sizes %s; %s) in %.1f s",
            len(self.keys),
            self.sizes,
            ", ".join(
                f"{s.mode.name}{s.variant and ' ' + s.variant} x{s.tokens_per_row}"
                for s in self.specs.values()
            ),
            time.perf_counter() - t0,
        )

    def run(
        self, mode: ForwardMode, bt: BatchTensors, variant: str = "", rows: int = 0
    ) -> tuple[torch.Tensor, ...]:
        """Outputs of the real rows' tokens: each of the mode's (variant's) forward(...)
        tensors [:bs * tokens_per_row] (`can_run` first); the graph padded for at least
        `rows` rows (ranks that agree on one size)."""
        bs = len(bt.seq_lens_cpu)
        spec = self.specs[mode, variant]
        t = spec.tokens_per_row
        key = GraphKey(mode, padded_batch_size(max(bs, rows), self.sizes), t, variant)
        seq_lens = self.buf.fill(bt, key)
        self.num_runs += 1
        if self.mode == "static":
            out = spec.forward(self._prepare(key, seq_lens))
            return tuple(x[: bs * t] for x in out)
        if spec.backend.replay_plans:  # NOTE: else the metadata would be views only
            self._prepare(key, seq_lens)
        self.graphs[key].replay()
        return self._real_rows(key, bs * t)

    def _real_rows(self, key: GraphKey, n: int) -> tuple[torch.Tensor, ...]:
        """The first n tokens' rows of each of the key's outputs: views made once per
        (key, n) and kept (a replay writes the same tensors)."""
        views = self._views.get((key, n))
        if views is None:
            views = self._views[key, n] = tuple(x[:n] for x in self.outputs[key])
        return views
