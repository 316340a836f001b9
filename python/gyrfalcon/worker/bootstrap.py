"""A worker rank from nothing: its device, its place among the ranks (torch.distributed
process groups when it shares its DP group with other TP ranks), its share of the
model, its KV cache."""

from __future__ import annotations

import logging
from datetime import timedelta

import torch

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.nodes import tp_groups_within_nodes
from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.forward.distributed import init_tensor_parallel
from gyrfalcon.forward.parallel import SINGLE_RANK
from gyrfalcon.ipc.contract import RankLayout
from gyrfalcon.worker.kv_sizing import max_model_len, num_kv_pages, profile_context
from gyrfalcon.worker.memory_profile import measure_largest_step
from gyrfalcon.worker.step_worker import StepWorker, rank_device

logger = logging.getLogger(__name__)


def build_worker(
    args: ServerArgs,
    model_dir: str,
    cfg: ModelConfig,
    rank: int,
    layout: RankLayout | None = None,
) -> tuple[StepWorker, int]:
    """Join the ranks' process groups when its DP group has several TP ranks (`layout`),
    load this rank's share of the model, then size and allocate the KV cache; returns
    (worker, context len)."""
    device = rank_device(args, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    layout = layout or RankLayout()
    parallel = SINGLE_RANK
    if args.joins_process_groups():  # NOTE: else DP groups share no collective
        assert args.dist_init_addr is not None, "the launcher sets --dist-init-addr"
        timeout = timedelta(seconds=args.dist_timeout)
        # NOTE: the one-shot all-reduce writes into peers' memory: only within one node
        # (for the TP groups; for the world, DP attention's expert group)
        custom, world = not args.disable_custom_all_reduce, layout.world_size
        one_shot = custom and tp_groups_within_nodes(world, layout.tp_size, args.nnodes)
        whole = custom and tp_groups_within_nodes(world, world, args.nnodes)
        parallel = init_tensor_parallel(
            rank, world, layout.tp_size, args.dist_init_addr, device, timeout, args.ep_size,
            one_shot, not args.disable_pdl, whole,
        )  # fmt: skip
        if cfg.num_experts:
            how = "expert parallel" if args.ep_size > 1 else "MoE-TP"
            group = layout.world_size if parallel.expert is not None else layout.tp_size
            logger.info("rank %d: MoE experts split %s over %d ranks", rank, how, group)
    worker = StepWorker(args, cfg, model_dir, rank, layout.dp_rank(rank), parallel)
    executor = worker.executor
    tp_size = executor.ctx.parallel.tp_size
    draft = worker.drafter.cfg.layer if worker.drafter else None
    kv_dtype = args.kv_dtype(executor.dtype)
    step_peak, resident = 0, None
    if worker.device.type == "cuda" and args.num_kv_pages is None and args.kv_cache_memory is None:
        step_peak, resident = measure_largest_step(worker, profile_context(args, cfg))
        logger.info("rank %d: the largest step takes %.2f GiB", rank, step_peak / (1 << 30))
    pages = num_kv_pages(args, cfg, kv_dtype, worker.device, tp_size, draft, step_peak, resident)
    context = max_model_len(args, cfg, pages)
    worker.init_kv_cache(pages, context)
    worker.warm_up(context)  # NOTE: may shrink the cache, and the context with it
    return worker, worker.max_model_len
