"""flashinfer attention: paged prefill/extend and decode, plans built once per step.

flashinfer describes a paged batch as CSR: `indptr` [bs + 1] (pages per row,
prefix-summed), `indices` (the rows' pages, concatenated) and `last_page_len`
[bs] (tokens in each row's last page, 1..page_size). We derive all three from
the ForwardBatch once per step; every layer's `forward` only runs.

Decode under CUDA graphs uses one graph-mode decode wrapper per captured batch
size, all sharing static indptr/indices/last_page_len buffers; `prepare_replay`
re-plans the wrapper of the padded size before each replay.

A plan copies its schedule to the device from a page-locked host buffer of the
wrapper, asynchronously. With the next step planned while this one runs, the
host must not rewrite that buffer before the copy has run: every plan waits on
an event recorded after the previous plan (by then, at most the step in flight
is ahead of it on the stream, so the wait is short).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.host_copy import upload
from gyrfalcon.layers.attention.base import AttentionBackend

WORKSPACE_BYTES = 256 << 20
FLASHINFER_HEAD_DIMS = (64, 128, 256)  # the head dims flashinfer has kernels for


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


@dataclass
class FlashInferMeta:
    decode: bool  # all rows have one query token: the decode wrapper runs
    wrapper: object


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"
    supports_cuda_graph = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        if head_dim not in FLASHINFER_HEAD_DIMS:
            raise ValueError(
                f"flashinfer has no kernels for head_dim {head_dim}; use --attention-backend triton"
            )
        import flashinfer

        self._fi = flashinfer
        self._device: torch.device | None = None
        self._graph_wrappers: dict[int, object] = {}
        # NOTE: tensor-core decode is faster for GQA groups of 4 and more
        self._tensor_cores = num_heads // num_kv_heads >= 4

    def _ensure(self, device: torch.device) -> None:
        if self._device is not None:
            return
        self._device = device
        self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._decode = self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace, "NHD", use_tensor_cores=self._tensor_cores
        )
        self._prefill = self._fi.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._plan_done = torch.cuda.Event() if device.type == "cuda" else None

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

    def build_metadata(self, batch: ForwardBatch) -> FlashInferMeta:
        self._ensure(batch.input_ids.device)
        bs = batch.batch_size
        assert batch.page_table.shape[0] == bs and sum(batch.q_lens_cpu) == batch.num_tokens
        csr = paged_csr(batch.seq_lens_cpu, batch.page_table.shape[1], batch.page_size)
        indices = self._indices(batch, csr)
        if all(n == 1 for n in batch.q_lens_cpu):
            self._plan_decode(self._decode, batch, csr, indices)
            return FlashInferMeta(True, self._decode)
        qo_indptr = [0]
        for n in batch.q_lens_cpu:
            qo_indptr.append(qo_indptr[-1] + n)
        dtype = batch.kv_cache.k.dtype
        assert dtype.itemsize == 2, "the flashinfer backend reads 16-bit KV caches only"
        self._plan(
            self._prefill,
            torch.tensor(qo_indptr, dtype=torch.int32),
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
        return FlashInferMeta(False, self._prefill)

    # ------------------------------------------------------------ CUDA graphs

    def capture_buffers(self, max_bs: int, max_pages: int, device: torch.device) -> None:
        self._ensure(device)
        self._g_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device=device)
        self._g_indices = torch.zeros(max_bs * max_pages, dtype=torch.int32, device=device)
        self._g_last = torch.ones(max_bs, dtype=torch.int32, device=device)

    def prepare_replay(self, batch: ForwardBatch) -> FlashInferMeta:
        bs = batch.batch_size
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is None:
            wrapper = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace,
                "NHD",
                use_cuda_graph=True,
                use_tensor_cores=self._tensor_cores,
                paged_kv_indptr_buffer=self._g_indptr[: bs + 1],
                paged_kv_indices_buffer=self._g_indices,
                paged_kv_last_page_len_buffer=self._g_last[:bs],
            )
            self._graph_wrappers[bs] = wrapper
        csr = paged_csr(batch.seq_lens_cpu, batch.page_table.shape[1], batch.page_size)
        self._plan_decode(wrapper, batch, csr, self._indices(batch, csr))
        return FlashInferMeta(True, wrapper)

    # ------------------------------------------------------------ forward

    def attend(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        meta: FlashInferMeta = batch.attn_meta
        cache = batch.kv_cache
        ps = batch.page_size
        shape = (-1, ps, self.num_kv_heads, self.head_dim)
        kv = (cache.k[layer].view(shape), cache.v[layer].view(shape))
        out = meta.wrapper.run(q, kv)  # [T, H, D]
        return out.reshape(q.shape[0], -1)
