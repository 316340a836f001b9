"""Drive an EAGLE3 drafter through the steps of a spec-decode round on a paged KV cache:
DRAFT_EXTEND, one DRAFT_DECODE step fed each row's own last output, DRAFT_EXTEND after
that cached prefix (the CPU model tests and the GPU tests share it)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import RowInput, build_batch_tensors
from gyrfalcon.ipc.messages import ForwardMode

LENS = ((7, 3), (5, 3))  # per row: the first extend, then (after one decode) the second


@dataclass
class DraftRound:
    ids: list[torch.Tensor]  # per row: [n] the input ids in position order (CPU)
    hidden: list[torch.Tensor]  # per row: [n, H] the hidden each position consumed (CPU)
    outs: list[torch.Tensor]  # per row: [n, H] the forward's output per position (CPU)


def run_draft_round(drafter, backend, page_size: int, lens=LENS, seed: int = 1) -> DraftRound:
    """Rows of len a + 1 + b for (a, b) in lens at positions 0..n-1, their pages
    interleaved (page 0 is the dummy page); every forward leaves its input unchanged."""
    cfg, device = drafter.cfg, drafter.fc.weight.device
    dtype, lyr = drafter.fc.weight.dtype, cfg.layer
    gen = torch.Generator().manual_seed(seed)
    n = [a + 1 + b for a, b in lens]
    ids = [torch.randint(0, cfg.vocab_size, (m,), generator=gen) for m in n]
    aux = [torch.randn(m, 3 * cfg.target_hidden_size, generator=gen) for m in n]
    need = max(-(-m // page_size) for m in n)
    pages = [[1 + r + i * len(n) for i in range(need)] for r in range(len(n))]
    cache = KVCache(
        1, 1 + need * len(n), page_size, lyr.num_kv_heads, lyr.head_dim, dtype, device,
        kernels=drafter.ctx.kernels,
    )  # fmt: skip
    with torch.inference_mode():
        fused = [drafter.fuse(x.to(device, dtype)) for x in aux]

    def step(mode: ForwardMode, slices: list[slice], hidden: torch.Tensor) -> torch.Tensor:
        rows = [RowInput(s.start, i[s].tolist(), p) for i, p, s in zip(ids, pages, slices)]
        bt = build_batch_tensors(rows, page_size, device)
        batch = ForwardBatch.from_tensors(mode, bt, page_size, cache, backend)
        batch.attn_meta = backend.build_metadata(batch)
        kept = hidden.clone()
        with torch.inference_mode():
            out = drafter(batch, hidden)
        assert torch.equal(hidden, kept), "the forward wrote into its input"
        return out

    ext1 = [slice(0, a) for a, _ in lens]
    out1 = step(ForwardMode.DRAFT_EXTEND, ext1, torch.cat([f[s] for f, s in zip(fused, ext1)]))
    last = torch.tensor([a for a, _ in lens], device=device).cumsum(0) - 1
    out2 = step(ForwardMode.DRAFT_DECODE, [slice(a, a + 1) for a, _ in lens], out1[last])
    ext2 = [slice(a + 1, m) for (a, _), m in zip(lens, n)]
    out3 = step(ForwardMode.DRAFT_EXTEND, ext2, torch.cat([f[s] for f, s in zip(fused, ext2)]))
    hidden, outs = [], []
    for r, (a, b) in enumerate(lens):
        first, second = sum(x for x, _ in lens[:r]), sum(y for _, y in lens[:r])
        consumed = (fused[r][:a], out1[last[r]][None], fused[r][a + 1 :])
        produced = (out1[first : first + a], out2[r : r + 1], out3[second : second + b])
        hidden.append(torch.cat(consumed).float().cpu())
        outs.append(torch.cat(produced).float().cpu())
    return DraftRound(ids, hidden, outs)
