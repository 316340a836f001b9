"""Paged KV cache storage: one K and one V tensor per layer.

Layout per layer: [num_pages * page_size, num_kv_heads, head_dim]; the slot of
token position p of a request is page_table[p // page_size] * page_size + p % page_size.
Page 0 is the reserved dummy page that padded rows read and write.
"""

from __future__ import annotations

import torch

from gyrfalcon.layers.dispatch import use_fused


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_pages, self.page_size = num_pages, page_size
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # loc: [T] slots; k, v: [T, KVH, D]
        if use_fused(k):
            from gyrfalcon.kernels.kv_store import store_kv

            store_kv(k, v, self.k[layer], self.v[layer], loc)
            return
        self.k[layer].index_copy_(0, loc, k.to(self.k.dtype))
        self.v[layer].index_copy_(0, loc, v.to(self.v.dtype))

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem
