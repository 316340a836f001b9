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

Capture and replay feed the model the same way: `StaticBuffers.fill` writes a
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
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from gyrfalcon.forward.batch import ForwardBatch, decode_rows
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import BatchTensors
from gyrfalcon.ipc.contract import DUMMY_PAGE
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.base import CAPTURED_MODES, AttentionBackend

logger = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class GraphKey:
    """What one captured graph serves."""

    mode: ForwardMode
    batch_size: int  # padded rows
    tokens_per_row: int  # query tokens of every row (1: DECODE, k + 1: VERIFY)
    variant: str = ""  # another callable of the mode ("": the mode's forward)

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.tokens_per_row


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


# views `StaticBuffers.fill` keeps: rows x table widths in use, and padded sizes
MAX_VIEWS = 4096


@dataclass
class StaticBuffers:
    """Inputs of a captured step: rows [0, max_bs) of up to max(tokens_per_row) tokens."""

    # [3, max_bs * max tokens per row] int64: rows input_ids, positions, out_cache_loc
    # (one block, so `fill` writes all three with one copy from the step's upload,
    # where they are consecutive)
    tokens: torch.Tensor
    seq_lens: torch.Tensor  # [max_bs] int64
    page_table: torch.Tensor  # [max_bs, max_pages] int64
    page_size: int
    # per tokens-per-row t (constant: written once):
    q_lens: dict[int, torch.Tensor]  # [max_bs] int64, all t
    q_starts: dict[int, torch.Tensor]  # [max_bs] int64, arange * t
    # [3, max_bs * t] int64, padding rows' token rows: ids 0, positions 0 .. t - 1 a row,
    # their slots on the dummy page (`fill` copies a padded step's part in one copy)
    pad_tokens: dict[int, torch.Tensor]
    _views: dict[tuple, tuple[torch.Tensor, ...]] = field(default_factory=dict, repr=False)

    @classmethod
    def allocate(
        cls,
        max_bs: int,
        max_pages: int,
        page_size: int,
        device: torch.device,
        tokens_per_row: tuple[int, ...] = (1,),
    ) -> StaticBuffers:
        for t in tokens_per_row:
            # NOTE: a padded row's positions 0 .. t - 1 all live on the dummy page: its
            # page-table row names it ceil(t / page_size) times
            assert t >= 1 and -(-t // page_size) <= max_pages, (
                f"a padded row of {t} tokens needs {-(-t // page_size)} dummy-page "
                f"references, the page table holds {max_pages}"
            )

        def i64(values: list[int] | torch.Tensor) -> torch.Tensor:
            return torch.as_tensor(values, dtype=torch.int64).to(device)

        rows = torch.arange(max_bs)

        def pad_tokens(t: int) -> torch.Tensor:
            pos = torch.arange(max_bs * t) % t
            slots = DUMMY_PAGE * page_size + pos % page_size
            return i64(torch.stack([torch.zeros_like(pos), pos, slots]))

        return cls(
            tokens=torch.zeros(3, max_bs * max(tokens_per_row), dtype=torch.int64, device=device),
            seq_lens=torch.ones(max_bs, dtype=torch.int64, device=device),
            page_table=torch.zeros(max_bs, max_pages, dtype=torch.int64, device=device),
            page_size=page_size,
            q_lens={t: i64(torch.full((max_bs,), t)) for t in tokens_per_row},
            q_starts={t: i64(rows * t) for t in tokens_per_row},
            pad_tokens={t: pad_tokens(t) for t in tokens_per_row},
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
        return int(self.seq_lens.shape[0])

    @property
    def max_pages(self) -> int:
        return int(self.page_table.shape[1])

    def fill(self, bt: BatchTensors | None, key: GraphKey) -> list[int]:
        """Write real rows of `bt` and padding rows up to key.batch_size; returns the
        rows' sequence lengths.

        NOTE: padding rows hold token 0 at positions 0 .. t - 1 on the dummy page, with
        sequence length t (>= 1), t = key.tokens_per_row.
        """
        t, padded_bs = key.tokens_per_row, key.batch_size
        bs = 0 if bt is None else len(bt.seq_lens_cpu)
        assert bs <= padded_bs <= self.max_bs, (bs, padded_bs, self.max_bs)
        assert t in self.q_lens, f"no static buffers for {t} tokens per row"
        # NOTE: the views written are kept by their sizes (`_views`), and the padding comes
        # from `pad_tokens` in one copy: each torch call costs a GPU host ~10-20 us
        # (benchmarks/NOTES.md, stop 57), so a step's fill is three copies, and three
        # more calls when it is padded
        if bt is not None and bs:
            assert bt.input_ids.shape[0] == bs * t, f"{key.mode.name} rows carry {t} tokens each"
            width = bt.page_table.shape[1]
            assert width <= self.max_pages, f"page table width {width} > {self.max_pages}"
            tokens, seq_lens, table = self._view(("rows", bs * t, bs, width))
            tokens.copy_(bt.token_rows)
            seq_lens.copy_(bt.seq_lens)
            table.copy_(bt.page_table)
        if padded_bs > bs:  # NOTE: no launches (and no host time) when nothing is padded
            tokens, pad_tokens, seq_lens, table = self._view(("pad", bs, padded_bs, t))
            tokens.copy_(pad_tokens)
            seq_lens.fill_(t)
            table.fill_(DUMMY_PAGE)
        seq_lens = [] if bt is None else list(bt.seq_lens_cpu)
        return seq_lens + [t] * (padded_bs - bs)

    def _view(self, key: tuple) -> tuple[torch.Tensor, ...]:
        """The views `fill` writes for `key`: ("rows", tokens, rows, table width) or
        ("pad", first padding row, padded rows, tokens per row). Made once each; at
        most MAX_VIEWS kept."""
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= MAX_VIEWS:
                self._views.clear()
            if key[0] == "rows":
                _, n, bs, width = key
                views = (self.tokens[:, :n], self.seq_lens[:bs], self.page_table[:bs, :width])
            else:
                _, bs, padded_bs, t = key
                lo, hi = bs * t, padded_bs * t
                views = (self.tokens[:, lo:hi], self.pad_tokens[t][:, lo:hi],
                         self.seq_lens[bs:padded_bs], self.page_table[bs:padded_bs])  # fmt: skip
            self._views[key] = views
        return views

    def forward_batch(
        self,
        key: GraphKey,
        seq_lens: list[int],
        kv_cache: KVCache,
        backend: AttentionBackend,
    ) -> ForwardBatch:
        """The key's batch of rows [0, key.batch_size): views of these buffers (`fill`
        first)."""
        bs, t = key.batch_size, key.tokens_per_row
        n = key.num_tokens
        return ForwardBatch(
            mode=key.mode,
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            out_cache_loc=self.out_cache_loc[:n],
            seq_lens=self.seq_lens[:bs],
            q_lens=self.q_lens[t][:bs],
            q_starts=self.q_starts[t][:bs],
            page_table=self.page_table[:bs],
            seq_lens_cpu=seq_lens,
            q_lens_cpu=[t] * bs,
            page_size=self.page_size,
            kv_cache=kv_cache,
            attn_backend=backend,
            num_decode_rows=decode_rows(key.mode, bs if t == 1 else 0, bs),
        )


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
