"""Triton attention backend: paged split-KV decode and paged causal extend kernels.

Dispatch follows the batch's mode: the rows [0, batch.num_decode_rows) (every
row of a DECODE batch, the leading decodes of a MIXED one, none of a VERIFY
one) run the split-KV decode kernel; the rows after them run the extend kernel.
A mixed batch of decodes and prefill chunks thus reads each decode row's KV once
per KV head (the extend kernel would read it once per query head, without
splits). VERIFY and DRAFT_EXTEND batches whose rows all hold T (2..16) query
tokens run entirely on the decode kernel, one program row per query token
(`verify_tokens`): split-KV and one program per KV head, where the extend kernel
would run one program per query head over each row's whole KV. Under CUDA graphs,
where a row's T tokens' query heads of a KV head fit one program (`packs`), that
program holds them all and reads the row's keys once (`TritonMeta.packed`); eager
batches keep a program row per token, whatever their T (T varies from step to step
in eager DRAFT_EXTEND batches, and each packed T is a kernel build of its own, which
graph capture makes before serving but an eager step would make while serving).
Everything that needs host values (max_q_len) is computed once per step in
build_metadata, so `forward` launches kernels without host syncs.

DECODE batches, and packed verify rows, take RoPE and the new K/V write inside the
decode kernel (`attend_rope`), one launch less per layer.

The decode kernel splits each row's KV into `decode_kv_splits(bs, ...)` parts
(unless fixed in the constructor): enough (batch x KV head x split) programs to
fill the GPU a few times over, so a small batch does not leave SMs idle.

CUDA graphs: `prepare_replay` returns metadata that views the graph runner's
static batch (page table, lengths), so a captured graph reads fresh values on every
replay with nothing copied, and every grid depends only on the capture key: the
padded batch size times its tokens per row. `capture_buffers` allocates decode
scratch per split count for every mode's rows, shared across modes.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.ipc.contract import DUMMY_PAGE
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.kernels.attention_decode import decode_attention
from gyrfalcon.kernels.attention_extend import extend_attention
from gyrfalcon.kernels.attention_launch import (
    DecodeRope,
    DecodeScratch,
    alloc_decode_scratch,
    early_first_block,
    packs,
)
from gyrfalcon.kernels.device import num_sms
from gyrfalcon.kernels.dispatch import DEFAULT_KERNELS, KernelPolicy
from gyrfalcon.layers.attention.base import (
    AttentionBackend,
    check_capture,
    replay_tokens_per_row,
)
from gyrfalcon.layers.attention.triton_meta import (
    MAX_VERIFY_TOKENS,
    ONE_LAUNCH_MAX_KV_BYTES,
    TritonMeta,
    decode_kv_splits,
    verify_tokens,
)


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True
    replay_plans = False  # NOTE: prepare_replay only views the static batch
    device_lengths = True  # NOTE: both kernels read each row's length on the device
    supports_any_rows_graph = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        num_kv_splits: int | None = None,
        decode_block_n: int | None = None,
        extend_block_m: int | None = None,
        extend_block_n: int | None = None,
        kernels: KernelPolicy = DEFAULT_KERNELS,
        one_launch_max_kv_bytes: int = ONE_LAUNCH_MAX_KV_BYTES,
    ):
        """num_kv_splits: split-KV count of the decode kernel (its grid is
        (bs, KVH, num_kv_splits)); None picks it per batch size (decode_kv_splits).
        Block sizes default to the kernels' choice. kernels: the model's kernel policy
        (whether the decode kernel may launch with PDL). one_launch_max_kv_bytes: see
        ONE_LAUNCH_MAX_KV_BYTES (0: a MIXED batch's decode rows always take the decode
        kernel)."""
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        assert num_kv_splits is None or num_kv_splits >= 1, num_kv_splits
        self.num_kv_splits = num_kv_splits
        self.pdl = kernels.pdl
        self.decode_block_n = decode_block_n
        self.extend_block_m, self.extend_block_n = extend_block_m, extend_block_n
        self.one_launch_max_kv_bytes = one_launch_max_kv_bytes
        self._scratch: dict[int, DecodeScratch] = {}  # eager, by split count, grown on demand
        # CUDA graphs: decode scratch by split count, rows for every bs that uses it
        self._graph_scratch: dict[int, DecodeScratch] | None = None
        self._retired_scratch: list[DecodeScratch] = []  # outgrown, still read by graphs

    def kv_splits(self, bs: int, device: torch.device) -> int:
        if self.num_kv_splits is not None:
            return self.num_kv_splits
        return decode_kv_splits(bs, self.num_kv_heads, num_sms(device), self.head_dim)

    def packs(self, tokens_per_row: int) -> bool:
        """Whether verify rows of this many tokens run packed under graphs
        (kernels/attention_decode)."""
        return packs(tokens_per_row, self.num_heads // self.num_kv_heads)

    def _program_rows(self, bs: int, t: int) -> tuple[int, int]:
        """(the decode kernel's program rows, query tokens each) for a graph's bs rows of
        t tokens: (bs, t) packed, else (bs * t, 1)."""
        return (bs, t) if self.packs(t) else (bs * t, 1)

    # ------------------------------------------------------------ metadata

    def _decode_scratch(self, bs: int, device: torch.device) -> DecodeScratch:
        """Eager-mode scratch with at least bs rows (reused across steps and layers).

        NOTE: reuse is safe because every layer's launch merges its partials before
        the next launch on the same stream overwrites them.
        """
        splits = self.kv_splits(bs, device)
        s = self._scratch.get(splits)
        if s is None or s.mid_o.shape[0] < bs or s.mid_o.device != device:
            rows = max(bs, 2 * s.mid_o.shape[0] if s is not None else 1)
            s = alloc_decode_scratch(rows, self.num_heads, self.head_dim, splits, device)
            self._scratch[splits] = s
        return s

    def build_metadata(self, batch: ForwardBatch) -> TritonMeta:
        batch.check()
        nd = batch.num_decode_rows  # NOTE: from the mode (forward/batch.decode_rows)
        device = batch.seq_lens.device
        t = verify_tokens(batch.mode, batch.q_lens_cpu)
        i32 = torch.int32
        page_table, seq_lens = batch.page_table.to(i32), batch.seq_lens.to(i32)
        if t:
            # NOTE: int32 copies, as a MIXED step's decode rows take them: the decode
            # kernel's builds are per index dtype, and the warm-up makes the int32 ones
            # (the batch's own int64 tensors built 4 times while serving, stop 39)
            meta = self._verify_meta(batch, t, self._decode_scratch(batch.num_tokens, device))
            return replace(meta, page_table=page_table, seq_lens=seq_lens)
        if 0 < nd < batch.batch_size and self._one_launch(batch, nd):
            nd = 0  # NOTE: the decode rows are extend rows of one token
        ext_table, ext_lens = page_table, seq_lens
        if 0 < nd < batch.batch_size:  # NOTE: own copies (aligned), not views at row nd
            ext_table, ext_lens = batch.page_table[nd:].to(i32), batch.seq_lens[nd:].to(i32)
        return TritonMeta(
            page_table=page_table,
            seq_lens=seq_lens,
            ext_page_table=ext_table,
            ext_seq_lens=ext_lens,
            q_starts=batch.q_starts[nd:].to(i32),
            q_lens=batch.q_lens[nd:].to(i32),
            max_q_len=max(batch.q_lens_cpu[nd:], default=1),
            num_decode=nd,
            scratch=self._decode_scratch(nd, device) if nd else None,
        )

    def _one_launch(self, batch: ForwardBatch, nd: int) -> bool:
        """Whether the extend kernel takes the MIXED batch's nd decode rows too
        (ONE_LAUNCH_MAX_KV_BYTES): its reads of their keys and values, per query head."""
        per_token = 2 * self.num_heads * self.head_dim * batch.kv_cache.k.element_size()
        return sum(batch.seq_lens_cpu[:nd]) * per_token <= self.one_launch_max_kv_bytes

    # ------------------------------------------------------------ CUDA graphs

    def capture_buffers(
        self,
        max_bs: int,
        max_pages: int,
        device: torch.device,
        mode: ForwardMode = ForwardMode.DECODE,
        tokens_per_row: int = 1,
    ) -> None:
        """Decode scratch per split count, for up to max_bs * tokens_per_row query rows
        (VERIFY and DRAFT_EXTEND run on the decode kernel too: `verify_tokens`; packed,
        their split count is that of their rows); kept across calls where large
        enough, so every mode's graphs share it."""
        check_capture(mode, tokens_per_row)
        have = self._graph_scratch or {}
        rows, per_row = self._program_rows(max_bs, tokens_per_row)
        need = {s: n * per_row for s, n in self._rows_by_splits(rows, device).items()}
        for s, n in need.items():
            if s not in have or have[s].mid_o.shape[0] < n:
                if s in have:  # NOTE: graphs captured before may point into it: kept alive
                    self._retired_scratch.append(have[s])
                have[s] = alloc_decode_scratch(n, self.num_heads, self.head_dim, s, device)
        self._graph_scratch = have

    def _rows_by_splits(self, max_rows: int, device: torch.device) -> dict[int, int]:
        """Split count -> the largest row count in 1..max_rows that uses it."""
        return {self.kv_splits(n, device): n for n in range(1, max_rows + 1)}

    def warm_up_kernels(
        self,
        kv_cache: KVCache,
        dtype: torch.dtype,
        max_rows: int,
        page_size: int,
        eager_decode_rows: range = range(0),
    ) -> None:
        """The decode kernel for every split count the rows of an eager step may pick, on
        the dummy page: a MIXED step's decode rows (q rotated, its K/V in the cache) and
        the query tokens of eager VERIFY / DRAFT_EXTEND rows (`verify_tokens`: up to
        MAX_VERIFY_TOKENS a row, T a runtime argument), which launch the same build, as
        int32 tables, for up to max_rows rows; and eager DECODE batches of
        `eager_decode_rows` rows (those no graph holds), RoPE inside. The warm-up steps
        meet one of them; the rest would build while serving, ~0.7 s each
        (worker/compile_watch.py)."""
        for rows, rope in ((range(1, max_rows * MAX_VERIFY_TOKENS + 1), False),
                           (eager_decode_rows, True)):  # fmt: skip
            fewest: dict[tuple[int, bool], int] = {}  # a build -> the fewest rows that pick it
            for n in rows:
                fewest.setdefault(self._decode_build(n, kv_cache), n)
            for n in fewest.values():
                self._warm_launch(kv_cache, dtype, n, page_size, rope)

    def _decode_build(self, rows: int, kv_cache: KVCache) -> tuple[int, bool]:
        """What picks the decode kernel's build for `rows` program rows (one query token
        each) beside the warm-up's fixed arguments: (split count, EARLY_KV)."""
        splits = self.kv_splits(rows, kv_cache.k.device)
        # NOTE: the warm-up launches rows of one query token each, never packed
        return splits, early_first_block(rows, kv_cache.k[0], splits, self.pdl, False)

    def _warm_launch(
        self, kv_cache: KVCache, dtype: torch.dtype, n: int, page_size: int, rope: bool
    ) -> None:
        """One decode launch of n rows on the dummy page, its tensors as a step's: q (and,
        with RoPE, k and v) views of a qkv row, int32 tables, RoPE's int64 positions and
        slots and float32 cos | sin table."""
        device, h, kvh, d = kv_cache.k.device, self.num_heads, self.num_kv_heads, self.head_dim
        qkv = torch.zeros(n, (h + 2 * kvh) * d, dtype=dtype, device=device)
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        q = q.view(n, h, d)
        table = torch.full((n, 1), DUMMY_PAGE, dtype=torch.int32, device=device)
        lens = torch.ones(n, dtype=torch.int32, device=device)
        at = torch.full((n,), DUMMY_PAGE * page_size, dtype=torch.int64, device=device)
        cos_sin = torch.zeros(1, d, dtype=torch.float32, device=device)
        decode_attention(
            q, kv_cache.k[0], kv_cache.v[0], table, lens, torch.empty_like(q),
            self._decode_scratch(n, device), page_size, self.scale,
            block_n=self.decode_block_n, pdl=self.pdl,
            rope=DecodeRope(k.view(n, kvh, d), v.view(n, kvh, d), at - at, cos_sin, at)
            if rope else None,
        )  # fmt: skip

    def any_rows_fit(self, batch: ForwardBatch) -> bool:
        """A graph over any rows runs the decode rows on the decode kernel and the rest on
        the extend kernel's flat grid: any batch but one of verify rows (the decode
        kernel's rows of T tokens serve those; `verify_tokens`)."""
        return not verify_tokens(batch.mode, batch.q_lens_cpu)

    def prepare_any_rows(self, batch: ForwardBatch, decode_lens: torch.Tensor) -> TritonMeta:
        """Views of the static batch's rows, sized by the token count T and the row count
        R: the first min(R, T) rows on the decode kernel (those of decode_lens > 0, the
        rest skipped), then every row on the extend kernel's flat grid
        (kernels/attention_extend.py; a decode row's q_len is 0 there). The decode
        scratch is the graphs' (`capture_buffers`, grown here: outside any capture)."""
        assert batch.q_lens.shape == batch.seq_lens.shape == batch.q_starts.shape
        rows = batch.page_table.shape[0]
        assert rows == batch.q_lens.shape[0]
        m = min(rows, batch.num_tokens)
        assert decode_lens.shape == (m,), (decode_lens.shape, m)
        device = batch.seq_lens.device
        self.capture_buffers(m, batch.page_table.shape[1], device)
        assert self._graph_scratch is not None
        scratch = self._graph_scratch[self.kv_splits(m, device)]
        return self._rows_meta(
            batch, batch.num_tokens, flat=True, flat_decode_lens=decode_lens, scratch=scratch
        )

    def prepare_replay(self, batch: ForwardBatch) -> TritonMeta:
        """Metadata that views the batch's own page table, lengths and query offsets:
        under graphs the batch is the graph runner's static buffers, refilled before
        every replay, so nothing is copied (the kernels take int64 indices)."""
        t = replay_tokens_per_row(batch)
        bs = batch.batch_size
        assert self._graph_scratch is not None, "capture_buffers must run before prepare_replay"
        if t > 1:  # VERIFY, DRAFT_EXTEND: rows of k + 1 tokens
            rows, _ = self._program_rows(bs, t)
            scratch = self._graph_scratch[self.kv_splits(rows, batch.seq_lens.device)]
            return self._verify_meta(batch, t, scratch, self.packs(t))
        return TritonMeta(
            page_table=batch.page_table,
            seq_lens=batch.seq_lens,
            ext_page_table=batch.page_table[:0],  # no extend rows
            ext_seq_lens=batch.seq_lens[:0],
            q_starts=batch.seq_lens[:0],
            q_lens=batch.seq_lens[:0],
            max_q_len=1,
            num_decode=bs,
            scratch=self._graph_scratch[self.kv_splits(bs, batch.seq_lens.device)],
        )

    @staticmethod
    def _verify_meta(
        batch: ForwardBatch, t: int, scratch: DecodeScratch, packed: bool = False
    ) -> TritonMeta:
        """Rows of t query tokens each on the decode kernel (`verify_tokens`)."""
        return TritonBackend._rows_meta(batch, t, scratch=scratch, verify_tokens=t, packed=packed)

    @staticmethod
    def _rows_meta(batch: ForwardBatch, max_q_len: int, **kw) -> TritonMeta:
        """Every row an extend row, viewing the batch's own page table, lengths and query
        offsets (nothing built); kw: the remaining TritonMeta fields (scratch, how the
        rows attend)."""
        return TritonMeta(
            page_table=batch.page_table,
            seq_lens=batch.seq_lens,
            ext_page_table=batch.page_table,
            ext_seq_lens=batch.seq_lens,
            q_starts=batch.q_starts,
            q_lens=batch.q_lens,
            max_q_len=max_q_len,
            num_decode=0,
            scratch=kw.pop("scratch", None),
            **kw,
        )

    # ------------------------------------------------------------ forward

    def fuses_rope(self, batch: ForwardBatch) -> bool:
        meta: TritonMeta = batch.attn_meta
        return meta.is_decode or meta.packed

    def _decode(self, q, layer, batch, table, lens, out, **kw) -> None:
        """One decode-kernel launch of the step's metadata (kw: `decode_attention`'s
        rope, tokens_per_row, pack)."""
        scratch = batch.attn_meta.scratch
        assert scratch is not None
        k, v, ps = batch.kv_cache.k[layer], batch.kv_cache.v[layer], batch.page_size
        decode_attention(
            q, k, v, table, lens, out, scratch, ps, self.scale, block_n=self.decode_block_n,
            pdl=self.pdl, **kw,
        )  # fmt: skip

    def attend_rope(self, q, k, v, positions, cos_sin, layer, batch) -> torch.Tensor:
        meta: TritonMeta = batch.attn_meta
        assert self.fuses_rope(batch)
        bs = q.shape[0]
        assert q.shape == (bs, self.num_heads, self.head_dim), q.shape
        out = q.new_empty(q.shape)
        rope = DecodeRope(k, v, positions, cos_sin, batch.out_cache_loc)
        self._decode(
            q, layer, batch, meta.page_table, meta.seq_lens, out, rope=rope,
            tokens_per_row=meta.verify_tokens or 1, pack=meta.packed,
        )  # fmt: skip
        return out.view(bs, -1)

    def attend(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        meta: TritonMeta = batch.attn_meta
        num_tokens = q.shape[0]
        assert q.shape == (num_tokens, self.num_heads, self.head_dim), q.shape
        # NOTE: q may be a strided view of the qkv projection: the kernels take its
        # strides, so no copy. On the flat grid no row covers a graph's padding tokens:
        # their output is zero, not whatever the memory held.
        out = q.new_zeros(q.shape) if meta.flat else q.new_empty(q.shape)  # [T, H, D]
        if meta.flat_decode_lens is not None:  # NOTE: prepare_any_rows: rows of length 0 skip
            m = meta.flat_decode_lens.shape[0]
            self._decode(q[:m], layer, batch, meta.page_table[:m], meta.flat_decode_lens, out[:m])
        if meta.verify_tokens:
            self._decode(
                q, layer, batch, meta.page_table, meta.seq_lens, out,
                tokens_per_row=meta.verify_tokens, pack=meta.packed,
            )  # fmt: skip
            return out.view(num_tokens, -1)
        nd = meta.num_decode
        if nd:
            self._decode(q[:nd], layer, batch, meta.page_table[:nd], meta.seq_lens[:nd], out[:nd])
        if nd < meta.page_table.shape[0]:  # NOTE: q_starts index the whole [T]
            cache = batch.kv_cache
            extend_attention(
                q, cache.k[layer], cache.v[layer], meta.ext_page_table, meta.q_starts,
                meta.q_lens, meta.ext_seq_lens, out, meta.max_q_len, batch.page_size,
                self.scale, block_m=self.extend_block_m, block_n=self.extend_block_n,
                flat=meta.flat,
            )  # fmt: skip
        return out.view(num_tokens, -1)
