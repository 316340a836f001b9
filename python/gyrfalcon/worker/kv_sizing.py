"""How many KV pages to allocate, and the context length they allow."""

from __future__ import annotations

import logging

import torch

from gyrfalcon.config.cli_args import parse_size
from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.parallel import local_heads

logger = logging.getLogger(__name__)


def available_cpu_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def kv_budget_bytes(args: ServerArgs, device: torch.device) -> int:
    if args.kv_cache_memory is not None:
        return parse_size(args.kv_cache_memory)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free  # weights and everything else already resident
        return max(0, int(total * args.mem_fraction) - used)
    return min(parse_size(args.max_cpu_kv_memory), int(available_cpu_memory() * args.mem_fraction))


def num_kv_pages(
    args: ServerArgs,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp_size: int,
    draft: ModelConfig | None = None,
) -> int:
    """Pages including the reserved dummy page, for one rank of a TP group of tp_size
    (a page holds that rank's KV heads only). draft: the drafter's layers, whose own
    pages come with every target page (drafter.py)."""
    if args.num_kv_pages is not None:
        return args.num_kv_pages
    per_page = 0
    for c in (cfg,) if draft is None else (cfg, draft):
        _, kv_heads = local_heads(c.num_heads, c.num_kv_heads, tp_size)
        per_page += KVCache.bytes_per_page(
            c.num_layers, args.page_size, kv_heads, c.head_dim, dtype
        )
    pages = kv_budget_bytes(args, device) // per_page
    if pages < 2:
        raise RuntimeError(
            f"KV cache budget too small: one page needs {per_page} bytes; "
            "raise --kv-cache-memory or --mem-fraction"
        )
    return int(pages)


def max_model_len(args: ServerArgs, cfg: ModelConfig, num_pages: int) -> int:
    """The context length: --max-model-len (at most the model's positions) or the
    model's, capped by what the KV cache holds."""
    if args.max_model_len is not None and args.max_model_len > cfg.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {args.max_model_len} exceeds the model's "
            f"{cfg.max_position_embeddings} positions (max_position_embeddings)"
        )
    want = args.max_model_len or cfg.max_position_embeddings
    capacity = (num_pages - 1) * args.page_size
    if want > capacity:
        logger.warning("context length %d capped to KV capacity %d tokens", want, capacity)
    return min(want, capacity)
