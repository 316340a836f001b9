"""Ragged paged batches for attention backend tests, on any device: rows of (prefix,
new tokens) on scrambled pages of a cache full of garbage. Imports no kernel, so the
interpreter cases (triton_attention_cases.py) and the GPU tests share it."""

import torch

from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import RowInput, build_batch_tensors

CPU = torch.device("cpu")


def paged_case(
    spec, num_kv_heads, head_dim, page_size, seed, pad_rows=0, kv_dtype=torch.float32,
    device=CPU, spare_pages=3,
):  # fmt: skip
    """spec: (prefix, q_len) per row -> (cache, rows); pages are scrambled, page 0 (the
    dummy page) unused by real rows, spare_pages more than the rows need.

    Prefix KV is written as an earlier step would have; pad_rows decode rows of
    length 1 on the dummy page are appended.
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(p + n) // page_size) for p, n in spec]
    perm = (torch.randperm(sum(need) + spare_pages, generator=gen) + 1).tolist()
    cache = KVCache(
        2, sum(need) + spare_pages + 1, page_size, num_kv_heads, head_dim, kv_dtype, device
    )
    # garbage everywhere (the dummy page included)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen).to(kv_dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen).to(kv_dtype))
    rows = []
    for (prefix, n), count in zip(spec, need):
        pages, perm = perm[:count], perm[count:]
        rows.append(RowInput(prefix, [0] * n, pages))
    rows += [RowInput(0, [0], [0])] * pad_rows
    return cache, rows


def paged_batch(rows, cache, backend, mode, page_size) -> ForwardBatch:
    """The rows' batch on the cache's device with `backend`'s metadata built."""
    bt = build_batch_tensors(rows, page_size, cache.k.device)
    batch = ForwardBatch.from_tensors(mode, bt, page_size, cache, backend)
    batch.attn_meta = backend.build_metadata(batch)
    return batch


def replay_batch(rows, cache, backend, mode, page_size) -> ForwardBatch:
    """The rows' batch as a CUDA graph of their size replays it: views of the graph
    runner's static buffers, with `backend`'s replay metadata (`prepare_replay`).
    Every row holds the same number of tokens."""
    from gyrfalcon.worker.static_buffers import GraphKey, StaticBuffers

    device, t, bs = cache.k.device, len(rows[0].input_ids), len(rows)
    max_pages = max(len(r.pages) for r in rows)
    backend.capture_buffers(bs, max_pages, device, mode, t)
    buf = StaticBuffers.allocate(bs, max_pages, page_size, device, tokens_per_row=(1, t))
    key = GraphKey(mode, bs, t)
    bt = build_batch_tensors(rows, page_size, device)
    batch = buf.forward_batch(key, buf.fill(bt, key), cache, backend)
    batch.attn_meta = backend.prepare_replay(batch)
    return batch
