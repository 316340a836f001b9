"""flashinfer attention: paged prefill/extend and decode, plans built once per step.

flashinfer describes a paged batch as CSR: `indptr` [bs + 1] (pages per row,
prefix-summed), `indices` (the rows' pages, concatenated) and `last_page_len`
[bs] (tokens in each row's last page, 1..page_size). We derive all three from
the ForwardBatch once per step; every layer's `forward` only runs.

The mode picks the wrapper: DECODE (one token per row) the decode wrapper,
every other mode (PREFILL, MIXED, VERIFY, ...) the paged prefill wrapper, causal
inside each row after its cached prefix.

CUDA graphs: one graph-mode wrapper per capture key (mode, padded batch size),
those of one mode sharing static indptr/indices/last_page_len buffers (and, for
VERIFY, a qo_indptr buffer, arange * (k + 1)); `prepare_replay` re-plans the
key's wrapper before each replay. DECODE keys use decode wrappers, VERIFY keys
paged prefill wrappers with k + 1 query tokens per row.

Every wrapper keeps its own int workspace and pinned host buffer (its plan); the
float workspace (split-KV partials, written only while a kernel runs) is one
`FlashInferWorkspace` per device, shared by the backend instances of every role,
whose launches are serialized on one stream.

A plan copies its schedule to the device from a page-locked host buffer of the
wrapper, asynchronously. With the next step planned while this one runs, the
host must not rewrite that buffer before the copy has run: every plan waits on
an event recorded after the previous plan (by then, at most the step in flight
is ahead of it on the stream, so the wait is short).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyrfalcon.config.attention import FLASHINFER_HEAD_DIMS
from gyrfalcon.forward.batch import SINGLE_TOKEN_MODES, ForwardBatch
from gyrfalcon.forward.host_copy import upload
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.base import (
    AttentionBackend,
    check_capture,
    replay_tokens_per_row,
)

WORKSPACE_BYTES = 256 << 20


@dataclass
class PagedCsr:
    indptr: list[int]  # [bs + 1]
    flat_index: list[int]  # positions in page_table.flatten() of every used page
    last_page_len: list[int]  # [bs]


def paged_csr(seq_lens: list[int], max_pages: int, page_size: int) -> PagedCsr:
    """CSR page layout of a batch whose row b uses ceil(seq_lens[b] / page_size) pages.

    flat_index[i] = b * max_pages + j for the j-th page of row b, so
    indices = page_table.flatten()[flat_index] without a device sync.
    """
    indptr = [0]
    flat: list[int] = []
    last: list[int] = []
    for b, n in enumerate(seq_lens):
        assert n >= 1, "flashinfer rows need at least one KV token"
        pages = -(-n // page_size)
        assert pages <= max_pages, f"row {b} needs {pages} pages, table has {max_pages}"
        flat.extend(range(b * max_pages, b * max_pages + pages))
        indptr.append(indptr[-1] + pages)
        last.append(n - (pages - 1) * page_size)
    return PagedCsr(indptr, flat, last)


def qo_indptr(q_lens: list[int]) -> list[int]:
    """[bs + 1] prefix sums of the rows' query tokens."""
    out = [0]
    for n in q_lens:
        out.append(out[-1] + n)
    return out


class FlashInferWorkspace:
    """The float workspace of flashinfer's kernels, allocated on first use: one per
    device, shared by every backend instance (role) of a model."""

    def __init__(self, nbytes: int = WORKSPACE_BYTES):
        self.nbytes = nbytes
        self._buffers: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        buf = self._buffers.get(device)
        if buf is None:
            buf = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
            self._buffers[device] = buf
        return buf


@dataclass
class GraphCsr:
    """Static CSR buffers of one captured mode, shared by its wrappers (one per size)."""

    indptr: torch.Tensor  # [max_bs + 1] int32
    indices: torch.Tensor  # [max_bs * max_pages] int32
    last_page_len: torch.Tensor  # [max_bs] int32
    qo_indptr: torch.Tensor  # [max_bs + 1] int32, arange * tokens_per_row (prefill wrappers)


@dataclass
class FlashInferMeta:
    decode: bool  # a single-token mode: the decode wrapper runs
    wrapper: object


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = True

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        workspace: FlashInferWorkspace | None = None,
    ):
        """workspace: the float workspace shared with the model's other backend
        instances (one of its own when None)."""
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        if head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(
                f"flashinfer has no kernels for head_dim {head_dim}; use --attention-backend triton"
            )
        import flashinfer

        self._fi = flashinfer
        self._shared_workspace = workspace or FlashInferWorkspace()
        self._device: torch.device | None = None
        self._decode = self._prefill = None  # eager wrappers (`_eager_wrapper`)
        self._graph_csr: dict[ForwardMode, GraphCsr] = {}
        self._graph_wrappers: dict[tuple[ForwardMode, int], object] = {}  # by (mode, bs)
        # NOTE: tensor-core decode is faster for GQA groups of 4 and more
        self._tensor_cores = num_heads // num_kv_heads >= 4

    def _ensure(self, device: torch.device) -> None:
        if self._device is not None:
            return
        self._device = device
        self._workspace = self._shared_workspace.get(device)
        self._plan_done = torch.cuda.Event() if device.type == "cuda" else None

    def _eager_wrapper(self, decode: bool):
        """The eager decode or prefill wrapper, made on first use (a role's instance
        may never need the other: each wrapper holds an int workspace of its own)."""
        if decode:
            if self._decode is None:
                self._decode = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=self._tensor_cores
                )
            return self._decode
        if self._prefill is None:
            self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        return self._prefill

    def _plan(self, wrapper, *args, **kwargs) -> None:
        """wrapper.plan(...), never overwriting a pinned schedule whose copy is pending."""
        if self._plan_done is not None:
            self._plan_done.synchronize()  # no-op before the first record
        wrapper.plan(*args, **kwargs)
        if self._plan_done is not None:
            self._plan_done.record()

    def _indices(self, batch: ForwardBatch, csr: PagedCsr, out: torch.Tensor | None = None):
        flat = upload(csr.flat_index, torch.int64, batch.page_table.device)
        idx = batch.page_table.reshape(-1)[flat].to(torch.int32)
        if out is None:
            return idx
        out[: idx.shape[0]].copy_(idx)
        return out

    def _plan_decode(self, wrapper, batch: ForwardBatch, csr: PagedCsr, indices) -> None:
        dtype = batch.kv_cache.k.dtype
        assert dtype.itemsize == 2, "the flashinfer backend reads 16-bit KV caches only"
        self._plan(
            wrapper,
            torch.tensor(csr.indptr, dtype=torch.int32),
            indices,
            torch.tensor(csr.last_page_len, dtype=torch.int32),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            batch.page_size,
            pos_encoding_mode="NONE",
            q_data_type=dtype,
            kv_data_type=dtype,
            sm_scale=self.scale,
        )

    def _plan_prefill(self, wrapper, batch: ForwardBatch, csr: PagedCsr, indices) -> None:
        dtype = batch.kv_cache.k.dtype
        assert dtype.itemsize == 2, "the flashinfer backend reads 16-bit KV caches only"
        self._plan(
            wrapper,
            torch.tensor(qo_indptr(batch.q_lens_cpu), dtype=torch.int32),
            torch.tensor(csr.indptr, dtype=torch.int32),
            indices,
            torch.tensor(csr.last_page_len, dtype=torch.int32),
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            batch.page_size,
            causal=True,  # NOTE: flashinfer aligns the causal mask to the end of the KV
            sm_scale=self.scale,
            q_data_type=dtype,
            kv_data_type=dtype,
        )

    def _plan_batch(self, wrapper, batch: ForwardBatch, decode: bool) -> FlashInferMeta:
        csr = paged_csr(batch.seq_lens_cpu, batch.page_table.shape[1], batch.page_size)
        plan = self._plan_decode if decode else self._plan_prefill
        plan(wrapper, batch, csr, self._indices(batch, csr))
        return FlashInferMeta(decode, wrapper)

    def build_metadata(self, batch: ForwardBatch) -> FlashInferMeta:
        batch.check()
        self._ensure(batch.input_ids.device)
        # NOTE: the prefill plan covers every row, decode rows of a MIXED batch included
        decode = batch.mode in SINGLE_TOKEN_MODES
        return self._plan_batch(self._eager_wrapper(decode), batch, decode)

    # ------------------------------------------------------------ CUDA graphs

    def capture_buffers(
        self,
        max_bs: int,
        max_pages: int,
        device: torch.device,
        mode: ForwardMode = ForwardMode.DECODE,
        tokens_per_row: int = 1,
    ) -> None:
        check_capture(mode, tokens_per_row)
        self._ensure(device)
        # NOTE: a new capture of the mode: its wrappers bind the new buffers
        self._graph_wrappers = {k: w for k, w in self._graph_wrappers.items() if k[0] != mode}
        i32 = dict(dtype=torch.int32, device=device)
        self._graph_csr[mode] = GraphCsr(
            indptr=torch.zeros(max_bs + 1, **i32),
            indices=torch.zeros(max_bs * max_pages, **i32),
            last_page_len=torch.ones(max_bs, **i32),
            qo_indptr=torch.arange(max_bs + 1, **i32) * tokens_per_row,
        )

    def _graph_wrapper(self, mode: ForwardMode, bs: int):
        """The graph-mode wrapper of capture key (mode, bs), made on first use."""
        wrapper = self._graph_wrappers.get((mode, bs))
        if wrapper is not None:
            return wrapper
        g = self._graph_csr[mode]
        if mode in SINGLE_TOKEN_MODES:
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self._tensor_cores,
                paged_kv_indptr_buffer=g.indptr[: bs + 1],
                paged_kv_indices_buffer=g.indices,
                paged_kv_last_page_len_buffer=g.last_page_len[:bs],
            )
        else:
            wrapper = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                qo_indptr_buf=g.qo_indptr[: bs + 1],
                paged_kv_indptr_buf=g.indptr[: bs + 1],
                paged_kv_indices_buf=g.indices,
                paged_kv_last_page_len_buf=g.last_page_len[:bs],
            )
        self._graph_wrappers[(mode, bs)] = wrapper
        return wrapper

    def prepare_replay(self, batch: ForwardBatch) -> FlashInferMeta:
        replay_tokens_per_row(batch)  # NOTE: VERIFY rows all hold the key's k + 1 tokens
        bs, mode = batch.batch_size, batch.mode
        assert mode in self._graph_csr, f"capture_buffers({mode.name}) must run first"
        wrapper = self._graph_wrapper(mode, bs)
        return self._plan_batch(wrapper, batch, mode in SINGLE_TOKEN_MODES)

    # ------------------------------------------------------------ forward

    def attend(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        meta: FlashInferMeta = batch.attn_meta
        cache = batch.kv_cache
        ps = batch.page_size
        shape = (-1, ps, self.num_kv_heads, self.head_dim)
        kv = (cache.k[layer].view(shape), cache.v[layer].view(shape))
        out = meta.wrapper.run(q, kv)  # [T, H, D]
        return out.reshape(q.shape[0], -1)
