"""A captured step's key (`GraphKey`) and its inputs (`StaticBuffers`): the buffers
every graph of a runner reads, and `fill`, which writes a step's real rows and its
padding rows into them (worker/cuda_graph.py describes the padding)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gyrfalcon.forward.batch import ForwardBatch, decode_rows
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import BatchTensors
from gyrfalcon.ipc.contract import DUMMY_PAGE
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.base import AttentionBackend


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
            tokens, seq_lens, table = self._view(("rows", bs, t, width))
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
        """The views `fill` writes for `key`: ("rows", rows, tokens per row, table
        width) or ("pad", first padding row, padded rows, tokens per row). Made once
        each; at most MAX_VIEWS kept."""
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= MAX_VIEWS:
                self._views.clear()
            if key[0] == "rows":
                _, bs, t, width = key
                views = (self.tokens[:, : bs * t], self.seq_lens[:bs], self.page_table[:bs, :width])
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
