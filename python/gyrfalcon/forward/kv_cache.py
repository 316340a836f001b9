"""Paged KV cache storage: one K and one V tensor per layer.

Layout per layer: [num_pages * page_size, num_kv_heads, head_dim]; the slot of
token position p of a request is page_table[p // page_size] * page_size + p % page_size.
Page 0 is the reserved dummy page that padded rows read and write.

An fp8 (e4m3) cache stores K/V cast without scaling, saturated at +-FP8_MAX;
attention reads convert back to the query dtype.
"""

from __future__ import annotations

import torch

from gyrfalcon.kernels.dispatch import DEFAULT_KERNELS, KernelPolicy

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x cast to the cache element type (saturating for fp8)."""
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-FP8_MAX, FP8_MAX).to(dtype)
    return x.to(dtype)


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
        kernels: KernelPolicy = DEFAULT_KERNELS,
    ):
        """num_kv_heads: the KV heads this rank holds. kernels: whether `write` may run
        the fused store kernel on CUDA."""
        self.num_pages, self.page_size = num_pages, page_size
        self.kernels = kernels
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def write(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        # loc: [T] slots; k, v: [T, KVH, D]
        if self.kernels.use_fused(k):
            from gyrfalcon.kernels.kv_store import store_kv

            store_kv(k, v, self.k[layer], self.v[layer], loc)
            return
        for cache, new in ((self.k[layer], k), (self.v[layer], v)):
            new = to_cache_dtype(new, cache.dtype)
            if cache.element_size() == 1:  # NOTE: no index_copy_ kernel for fp8 on CPU
                cache, new = cache.view(torch.uint8), new.view(torch.uint8)
            cache.index_copy_(0, loc, new)

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * elem
