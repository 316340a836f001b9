"""Rotary position embedding (rotate-half layout, as HF Llama/Qwen)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from gyrfalcon.layers.context import LayerContext


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with optional scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling {kind!r}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None,
        max_positions: int,
        ctx: LayerContext,
    ):
        super().__init__()
        self.max_positions = max_positions
        self.kernels = ctx.kernels
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)
        self.cos_sin_cache: torch.Tensor | None = None  # [max_positions, D] fp32, CUDA only

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: [T]; q: [T, H, D]; k: [T, KVH, D]
        if self.kernels.use_fused(q):
            from gyrfalcon.kernels.rotary import rotary_inplace

            return rotary_inplace(q, k, positions, self.cos_sin_table())
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos().to(q.dtype)[:, None, :]
        sin = emb.sin().to(q.dtype)[:, None, :]
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k

    def forward_and_store(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        loc: torch.Tensor,
    ) -> None:
        """CUDA only: `forward` in place on q, k, and k, v written to the layer's cache
        slots loc (`KVCache.write`), in one kernel."""
        from gyrfalcon.kernels.rotary import rotary_and_store

        rotary_and_store(q, k, v, positions, self.cos_sin_table(), k_cache, v_cache, loc)

    def cos_sin_table(self) -> torch.Tensor:
        """[max_positions, D] float32 cos | sin table (CUDA kernels)."""
        if self.cos_sin_cache is None:
            from gyrfalcon.kernels.rotary import build_cos_sin_cache

            # NOTE: built by the first (eager) forward, before any graph capture
            self.cos_sin_cache = build_cos_sin_cache(self.inv_freq, self.max_positions)
        return self.cos_sin_cache
