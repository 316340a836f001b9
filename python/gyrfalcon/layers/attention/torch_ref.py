"""Reference attention: gather pages + SDPA. Runs on CPU and GPU; the oracle in tests.

The decode rows (rows [0, batch.num_decode_rows), one new token each: every row
of a DECODE batch, the leading decodes of a MIXED one) are attended together,
padded to the longest KV length with a key mask. The other rows (prefill chunks,
verify rows) are attended one by one, causal with an offset of their cached
prefix. Every mask reads the lengths on the device (`batch.seq_lens`); the host
lengths only size the gathers, so they may be upper bounds (floating rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.layers.attention.base import AttentionBackend


def kv_slots(page_table_row: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """Slots of KV positions [0, length) of one request: [length] int64."""
    pos = torch.arange(length, device=page_table_row.device)
    return page_table_row[pos // page_size] * page_size + pos % page_size


@dataclass
class ExtendRow:
    token_start: int  # first new token of the row in [T]
    num_new: int
    prefix_len: int  # cached tokens before the new ones
    slots: torch.Tensor  # [prefix_len + num_new] KV slots
    mask: torch.Tensor | None  # [num_new, prefix_len + num_new] bool, None = plain causal


@dataclass
class TorchRefMeta:
    decode_tokens: torch.Tensor  # [nd] token indices of the decode rows (= their rows)
    decode_slots: torch.Tensor  # [nd, max_kv] KV slots (padding -> dummy slot 0)
    decode_mask: torch.Tensor  # [nd, 1, 1, max_kv] bool key mask
    extends: list[ExtendRow]


def gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache[slots] converted to dtype; fp8 caches are indexed as bytes (index kernels
    do not cover fp8 on every device)."""
    if cache.element_size() == 1:
        return cache.view(torch.uint8)[slots].view(cache.dtype).to(dtype)
    return cache[slots].to(dtype)


class TorchRefBackend(AttentionBackend):
    name = "torch_ref"
    device_lengths = True  # NOTE: every row is masked by the device lengths

    def build_metadata(self, batch: ForwardBatch) -> TorchRefMeta:
        batch.check()
        device = batch.input_ids.device
        ps = batch.page_size
        nd = batch.num_decode_rows  # NOTE: rows [0, nd) hold tokens [0, nd)
        extends: list[ExtendRow] = []
        start = nd
        for row in range(nd, batch.batch_size):
            q_len, seq_len = batch.q_lens_cpu[row], batch.seq_lens_cpu[row]
            prefix = seq_len - q_len  # NOTE: a host bound; 0 means 0 on the device too
            mask = None
            if prefix > 0:  # query i sits at position (device length - q_len) + i
                q_pos = torch.arange(q_len, device=device)[:, None] + (batch.seq_lens[row] - q_len)
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos
            slots = kv_slots(batch.page_table[row], seq_len, ps)
            extends.append(ExtendRow(start, q_len, prefix, slots, mask))
            start += q_len
        max_kv = max(batch.seq_lens_cpu[:nd], default=1)
        pos = torch.arange(max_kv, device=device)
        if nd:
            pt = batch.page_table[:nd]  # [nd, max_pages]
            lens = batch.seq_lens[:nd]  # [nd]
            valid = pos[None, :] < lens[:, None]  # [nd, max_kv]
            page_idx = torch.clamp(pos // ps, max=pt.shape[1] - 1)
            slots = pt[:, page_idx] * ps + pos % ps
            slots = torch.where(valid, slots, torch.zeros_like(slots))
            dmask = valid[:, None, None, :]
        else:
            slots = torch.zeros((0, max_kv), dtype=torch.int64, device=device)
            dmask = torch.zeros((0, 1, 1, max_kv), dtype=torch.bool, device=device)
        return TorchRefMeta(
            decode_tokens=torch.arange(nd, device=device),
            decode_slots=slots,
            decode_mask=dmask,
            extends=extends,
        )

    def attend(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        meta: TorchRefMeta = batch.attn_meta
        cache = batch.kv_cache
        k_all, v_all = cache.k[layer], cache.v[layer]  # [slots, KVH, D]
        out = torch.empty_like(q)  # [T, H, D]
        gqa = self.num_heads != self.num_kv_heads
        if meta.decode_tokens.numel() > 0:
            qd = q[meta.decode_tokens][:, :, None, :]  # [nd, H, 1, D]
            kd = gather(k_all, meta.decode_slots, q.dtype).transpose(1, 2)  # [nd, KVH, max_kv, D]
            vd = gather(v_all, meta.decode_slots, q.dtype).transpose(1, 2)
            od = F.scaled_dot_product_attention(
                qd, kd, vd, attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=gqa
            )
            out[meta.decode_tokens] = od[:, :, 0, :]
        for ext in meta.extends:
            sl = slice(ext.token_start, ext.token_start + ext.num_new)
            qe = q[sl].transpose(0, 1)[None]  # [1, H, n, D]
            ke = gather(k_all, ext.slots, q.dtype).transpose(0, 1)[None]  # [1, KVH, L, D]
            ve = gather(v_all, ext.slots, q.dtype).transpose(0, 1)[None]
            oe = F.scaled_dot_product_attention(
                qe,
                ke,
                ve,
                attn_mask=ext.mask,
                is_causal=ext.mask is None,
                scale=self.scale,
                enable_gqa=gqa,
            )
            out[sl] = oe[0].transpose(0, 1)
        return out.reshape(q.shape[0], -1)
