"""How many KV pages to allocate, and the context length they allow."""

from __future__ import annotations

import logging

import torch

from gyrfalcon.config.cli_args import parse_size
from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.config.sharding import local_heads
from gyrfalcon.forward.kv_cache import KVCache

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


SLACK_BYTES = 1 << 30  # kept free beyond a measured step peak: graph pools, fragmentation


def kv_budget(
    total: int, free: int, fraction: float, step_peak: int = 0, resident: int | None = None
) -> tuple[int, bool]:
    """(bytes for the KV cache on a device of `total` bytes with `free` free now, whether
    the largest step capped them): weights and KV together get `fraction` of the device,
    and where the largest step's activations were measured (`step_peak` > 0:
    memory_profile.py) they and SLACK_BYTES stay free beside the KV cache. `resident`:
    the bytes in use before that measurement (weights, the CUDA context); what the
    measuring run left resident (kernels, workspaces, buffers grown to the largest step)
    comes out of the rest of the device, as it would at the first large step, not out
    of the fraction; default: all in use now."""
    used = total - free if resident is None else resident
    by_fraction = int(total * fraction) - used
    if step_peak <= 0:
        return max(0, by_fraction), False
    beside_step = free - step_peak - SLACK_BYTES
    return max(0, min(by_fraction, beside_step)), beside_step < by_fraction


def kv_budget_bytes(
    args: ServerArgs, device: torch.device, step_peak: int = 0, resident: int | None = None
) -> int:
    if args.kv_cache_memory is not None:
        return parse_size(args.kv_cache_memory)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # NOTE: blocks torch holds but no tensor uses count as free
        free, total = torch.cuda.mem_get_info(device)
        budget, capped = kv_budget(total, free, args.mem_fraction, step_peak, resident)
        gib = 1 << 30
        if capped:
            logger.info(
                "KV cache %.2f GiB, less than --mem-fraction %.2f allows: the largest step "
                "needs %.2f GiB beside it", budget / gib, args.mem_fraction, step_peak / gib,
            )  # fmt: skip
        return budget
    return min(parse_size(args.max_cpu_kv_memory), int(available_cpu_memory() * args.mem_fraction))


def kv_page_bytes(
    args: ServerArgs,
    cfg: ModelConfig,
    dtype: torch.dtype,
    tp_size: int,
    draft: ModelConfig | None = None,
) -> int:
    """Bytes of one KV page on one rank of a TP group of tp_size: the target's layers,
    and the drafter's (`draft`), whose own page comes with every target page."""
    per_page = 0
    for c in (cfg,) if draft is None else (cfg, draft):
        _, kv_heads = local_heads(c.num_heads, c.num_kv_heads, tp_size)
        per_page += KVCache.bytes_per_page(
            c.num_layers, args.page_size, kv_heads, c.head_dim, dtype
        )
    return per_page


def pages_for_shortfall(pages: int, short: int, per_page: int) -> int:
    """The page count that frees at least `short` bytes from a KV cache of `pages` pages
    of `per_page` bytes each. Raises where fewer than 2 pages (the dummy page and one)
    would be left."""
    assert short > 0 and per_page > 0, (short, per_page)
    left = pages - -(-short // per_page)
    if left < 2:
        raise RuntimeError(
            f"the largest step leaves no room for a KV cache: {short / (1 << 30):.2f} GiB short "
            f"with {pages} pages; lower --max-num-batched-tokens or --max-num-seqs"
        )
    return left


def num_kv_pages(
    args: ServerArgs,
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp_size: int,
    draft: ModelConfig | None = None,
    step_peak: int = 0,
    resident: int | None = None,
) -> int:
    """Pages including the reserved dummy page, for one rank of a TP group of tp_size
    (a page holds that rank's KV heads only). draft: the drafter's layers, whose own
    pages come with every target page (drafter.py). step_peak: the largest step's
    activation bytes, kept free, and resident: the bytes in use before they were
    measured (`kv_budget`)."""
    if args.num_kv_pages is not None:
        return args.num_kv_pages
    per_page = kv_page_bytes(args, cfg, dtype, tp_size, draft)
    pages = kv_budget_bytes(args, device, step_peak, resident) // per_page
    if pages < 2:
        raise RuntimeError(
            f"KV cache budget too small: one page needs {per_page} bytes; "
            "raise --kv-cache-memory or --mem-fraction"
        )
    return int(pages)


def max_model_len(args: ServerArgs, cfg: ModelConfig, num_pages: int) -> int:
    """The context length: --max-model-len (at most the model's positions: refused
    beyond them when the flags resolve, `config/resolve.py` check_limits) or the
    model's, capped by what the KV cache holds."""
    want = args.max_model_len or cfg.max_position_embeddings
    capacity = (num_pages - 1) * args.page_size
    if want > capacity:
        logger.warning("context length %d capped to KV capacity %d tokens", want, capacity)
    return min(want, capacity)


def profile_context(args: ServerArgs, cfg: ModelConfig) -> int:
    """The context the memory profile's rows fit (`max_model_len` before the KV cache
    caps it)."""
    return args.max_model_len or cfg.max_position_embeddings
