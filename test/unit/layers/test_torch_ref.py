"""torch_ref attention on ragged paged batches against a dense per-request oracle."""

import torch

from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import RowInput, build_batch_tensors
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.torch_ref import TorchRefBackend


def dense_attention(q, k, v, prefix):
    # q: [n, H, D]; k, v: [L, KVH, D] with L = prefix + n; causal with offset
    h, kvh = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // kvh, dim=1)
    v = v.repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) / q.shape[-1] ** 0.5
    n, L = q.shape[0], k.shape[0]
    mask = torch.arange(L)[None, :] <= (torch.arange(n)[:, None] + prefix)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v).reshape(n, -1)


def test_ragged_mixed_batch_matches_dense():
    torch.manual_seed(0)
    H, KVH, D, ps = 6, 2, 16, 4
    cache = KVCache(1, 16, ps, KVH, D, torch.float32, torch.device("cpu"))
    backend = TorchRefBackend(H, KVH, D, D**-0.5)
    # (prefix, new tokens, pages) per row: decode, chunk after prefix, fresh prefill, decode at page edge
    spec = [(6, 1, [3, 5]), (5, 4, [1, 7, 9]), (0, 7, [2, 4]), (3, 1, [6])]
    hist = {}
    # write the cached prefixes first (as an earlier step would have)
    for i, (prefix, _, pages) in enumerate(spec):
        hist[i] = (torch.randn(prefix, KVH, D), torch.randn(prefix, KVH, D))
        if prefix:
            loc = torch.tensor([pages[p // ps] * ps + p % ps for p in range(prefix)])
            cache.write(0, loc, *hist[i])
    rows = [RowInput(prefix, [0] * n, pages) for prefix, n, pages in spec]
    bt = build_batch_tensors(rows, ps, torch.device("cpu"))
    T = bt.input_ids.shape[0]
    q, k, v = torch.randn(T, H, D), torch.randn(T, KVH, D), torch.randn(T, KVH, D)
    batch = ForwardBatch.from_tensors(ForwardMode.MIXED, bt, ps, cache, backend)
    batch.attn_meta = backend.build_metadata(batch)
    out = backend.forward(q, k, v, 0, batch)
    start = 0
    for i, (prefix, n, _) in enumerate(spec):
        sl = slice(start, start + n)
        kk = torch.cat([hist[i][0], k[sl]])
        vv = torch.cat([hist[i][1], v[sl]])
        torch.testing.assert_close(out[sl], dense_attention(q[sl], kk, vv, prefix))
        start += n
    # nothing was written to the dummy page
    assert cache.k[0, :ps].abs().sum() == 0


def test_verify_rows_attend_over_the_device_lengths():
    """Floating verify rows: a batch built at upper-bound starts and moved on the
    device (shift_rows) attends exactly as the batch built at the true starts; the host
    lengths only size the gathers."""
    from gyrfalcon.forward.metadata import shift_rows

    torch.manual_seed(1)
    H, KVH, D, ps = 4, 2, 8, 4
    backend = TorchRefBackend(H, KVH, D, D**-0.5)
    pages, true_start, latest = [[3, 5, 1], [2, 4]], [5, 2], [8, 4]  # 4 tokens each
    prefix_kv = [torch.randn(8, KVH, D), torch.randn(8, KVH, D)]
    q, k, v = torch.randn(8, H, D), torch.randn(8, KVH, D), torch.randn(8, KVH, D)
    outs = []
    for starts, shift in ((true_start, None), (latest, [-3, -2])):
        cache = KVCache(1, 8, ps, KVH, D, torch.float32, torch.device("cpu"))
        for i, pg in enumerate(pages):  # the rows' cached prefixes (and garbage after)
            loc = torch.tensor([pg[p // ps] * ps + p % ps for p in range(8)])
            cache.write(0, loc, prefix_kv[i], -prefix_kv[i])
        rows = [RowInput(s, [0] * 4, pg) for s, pg in zip(starts, pages)]
        bt = build_batch_tensors(rows, ps, torch.device("cpu"))
        if shift is not None:
            tokens = torch.arange(8)
            shift_rows(bt, torch.tensor([0, 1]), torch.tensor(shift), tokens, tokens // 4, ps)
        batch = ForwardBatch.from_tensors(ForwardMode.VERIFY, bt, ps, cache, backend)
        batch.attn_meta = backend.build_metadata(batch)
        outs.append(backend.forward(q, k, v, 0, batch))
    torch.testing.assert_close(outs[1], outs[0])
