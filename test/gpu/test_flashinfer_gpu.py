"""flashinfer backend == torch_ref (bf16) on ragged paged batches, eager and graph-planned."""

import pytest
import torch

from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import RowInput, build_batch_tensors
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.registry import create_backend

pytestmark = pytest.mark.gpu


def make_batch(spec, H, KVH, D, ps, backend, cache, gen):
    """spec: list of (prefix_len, new_tokens); pages assigned in scrambled order."""
    dev = cache.k.device
    free = torch.randperm(cache.num_pages - 1, generator=gen).add(1).tolist()
    rows = []
    for prefix, n in spec:
        need = -(-(prefix + n) // ps)
        pages = [free.pop() for _ in range(need)]
        if prefix:
            loc = torch.tensor([pages[p // ps] * ps + p % ps for p in range(prefix)], device=dev)
            cache.write(
                0,
                loc,
                torch.randn(prefix, KVH, D, device=dev),
                torch.randn(prefix, KVH, D, device=dev),
            )
        rows.append(RowInput(prefix, [0] * n, pages))
    bt = build_batch_tensors(rows, ps, dev)
    mode = ForwardMode.DECODE if all(n == 1 for _, n in spec) else ForwardMode.MIXED
    return ForwardBatch.from_tensors(mode, bt, ps, cache, backend)


@pytest.mark.parametrize("H,KVH,D", [(8, 8, 64), (12, 4, 64), (32, 8, 128), (16, 2, 128)])
@pytest.mark.parametrize("decode", [True, False])
def test_flashinfer_matches_torch_ref(H, KVH, D, decode):
    ps = 16
    dev = torch.device("cuda")
    spec = (
        [(15, 1), (16, 1), (17, 1), (0, 1), (300, 1), (1000, 1)]
        if decode
        else [(0, 37), (16, 1), (45, 5), (100, 64), (0, 1), (31, 4)]
    )
    out = {}
    for name in ("torch_ref", "flashinfer"):
        torch.manual_seed(0)
        cache = KVCache(1, 256, ps, KVH, D, torch.bfloat16, dev)
        backend = create_backend(name, H, KVH, D, D**-0.5)
        batch = make_batch(spec, H, KVH, D, ps, backend, cache, torch.Generator().manual_seed(1))
        T = batch.num_tokens
        q = torch.randn(T, H, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(T, KVH, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(T, KVH, D, device=dev, dtype=torch.bfloat16)
        batch.attn_meta = backend.build_metadata(batch)
        out[name] = backend.forward(q, k, v, 0, batch).float()
    torch.testing.assert_close(out["flashinfer"], out["torch_ref"], atol=2e-2, rtol=2e-2)
