"""The largest step's activation memory, measured before the KV cache is sized.

KV sizing (kv_sizing.py) gives the weights and the KV cache --mem-fraction of the
device; the rest must hold the activations of the largest step the scheduler can plan.
That step can be large: under DP attention with expert parallelism every MoE layer
gathers the tokens of every DP group (dp x --max-num-batched-tokens of them), and with
EAGLE3 every row of a VERIFY step scores k + 1 tokens over the whole vocabulary. So
before sizing, every rank runs the worst-case steps (`warmup.profile_batches`, through
the same path as the scheduler's) eagerly on a KV cache of two pages, and the memory
they reserve at peak (torch's reserved memory: the blocks the caching allocator took
from the device, fragmentation included) stays free beside the KV cache
(`kv_sizing.kv_budget`), with SLACK_BYTES for the graphs to come.

The graphs and NCCL take memory only once they are captured, beside the sized cache,
and how much depends on the model, the ranks and the capture sizes. So after the capture
and the warm-up the worker measures again (`memory_shortfall`): where less than the
peak and twice FIT_MARGIN_BYTES is free, it shrinks the KV cache by the shortfall and
captures again (`fit_kv_cache`). Last, the warm-up runs the steps once more
beside the real KV cache and graphs (`check_largest_step_fits`): a server whose largest
step does not fit fails at start-up with a clear message, not at its first burst of
requests.

On the CPU nothing is measured (torch keeps no peak there and KV sizing has its own
cap); the steps themselves run on any device, which is how the CPU tests cover them.
"""

from __future__ import annotations

import gc
import logging
from typing import TYPE_CHECKING

import torch

from gyrfalcon.worker.kv_sizing import kv_page_bytes, max_model_len, pages_for_shortfall
from gyrfalcon.worker.warmup import profile_batches

if TYPE_CHECKING:
    from gyrfalcon.worker.step_worker import StepWorker

logger = logging.getLogger(__name__)

PROFILE_PAGES = 2  # the dummy page and one more: the profile's rows use the dummy page only
FIT_MARGIN_BYTES = 256 << 20  # free beyond the measured peak once graphs are captured


def run_profile_steps(worker: StepWorker, context_len: int) -> None:
    """Run `profile_batches` on `worker` (KV cache allocated; its graphs, if any, are not
    replayed: warm-up batches run eagerly) and leave no request state behind. Every rank
    runs the same steps at the same time, so collectives line up."""
    args = worker.args
    budget, chunk = args.max_num_batched_tokens, args.chunked_prefill_size
    assert budget is not None and chunk is not None, "resolved server args"
    assert not worker.pending, "profile with steps in flight"
    batches = profile_batches(
        args.page_size, budget, args.max_num_seqs, chunk, context_len, worker.num_draft
    )
    for i, rb in enumerate(batches):
        worker.submit_batch(-1000 - i, rb)  # NOTE: negative step ids: never the scheduler's
        worker.take()
    assert not len(worker.requests), "profile requests left behind"


def step_peak_bytes(worker: StepWorker, context_len: int) -> int:
    """Bytes the largest steps take from `worker`'s CUDA device at peak (torch's reserved
    memory), beyond what is resident (weights); 0 on other devices, where the steps run
    unmeasured. Call before `init_kv_cache`: it allocates a KV cache of PROFILE_PAGES
    pages (the drafter's too), runs the steps eagerly (no graphs yet) and frees the
    cache again."""
    dev = worker.device
    cuda = dev.type == "cuda"
    ex, drafter = worker.executor, worker.drafter
    assert ex.kv_cache is None, "measure before the KV cache is allocated"
    ex.alloc_kv_cache(PROFILE_PAGES)
    if drafter is not None:
        drafter.init_kv_cache(PROFILE_PAGES, worker.args.kv_dtype(ex.dtype))
    worker.max_model_len = context_len
    base = 0
    if cuda:
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_reserved(dev)
    try:
        run_profile_steps(worker, context_len)
        if not cuda:
            return 0
        torch.cuda.synchronize(dev)
        # NOTE: reserved, not allocated: the blocks a step's pattern of frees leaves
        # unusable for its larger allocations are device memory it needs all the same
        return torch.cuda.max_memory_reserved(dev) - base
    finally:
        ex.kv_cache = None
        if drafter is not None:
            drafter.kv_cache = None
        worker.max_model_len = 0
        if cuda:
            torch.cuda.empty_cache()


def measure_largest_step(worker: StepWorker, context_len: int) -> tuple[int, int]:
    """(`step_peak_bytes` on CUDA, kept as `worker.step_peak`; the device bytes in use
    before it ran: what `--mem-fraction` counts from). Logs what the run left in use
    after it, by where it lies: tensors still referenced, blocks torch could not give
    back (a segment stays while any tensor in it lives), memory outside torch (kernels
    loaded, library workspaces)."""
    dev = worker.device
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info(dev)
    alloc0, res0 = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    worker.step_peak = step_peak_bytes(worker, context_len)
    free1, _ = torch.cuda.mem_get_info(dev)  # NOTE: after the run's own empty_cache
    alloc1, res1 = torch.cuda.memory_allocated(dev), torch.cuda.memory_reserved(dev)
    gib = 1 << 30
    logger.info(
        "the measuring run left %.2f GiB in use: %.2f GiB of tensors, %.2f GiB cached "
        "beside them, %.2f GiB outside torch", (free0 - free1) / gib, (alloc1 - alloc0) / gib,
        (res1 - alloc1 - res0 + alloc0) / gib, (free0 - free1 - res1 + res0) / gib,
    )  # fmt: skip
    return worker.step_peak, total - free0


def memory_shortfall(worker: StepWorker, margin: int = FIT_MARGIN_BYTES) -> int:
    """Bytes by which the device memory free now (beside the KV cache, the graphs and
    whatever else is resident) falls short of the largest step's measured peak and
    `margin`; 0 where it does not, or where nothing was measured."""
    if not worker.step_peak:
        return 0
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(worker.device)
    return max(0, worker.step_peak + margin - free)


def agreed_shortfall(worker: StepWorker) -> int:
    """What to give up, agreed by the ranks `worker` shares collectives with (its MoE
    group: the TP group, or every rank under DP attention with experts split over the
    DP groups), so that they all capture again or none does: the largest of their
    shortfalls against twice FIT_MARGIN_BYTES, counting only ranks short of the check's
    one margin (a capture again may keep a little more than the last gave back: the
    second margin absorbs it, rather than another round)."""
    short = 0
    if memory_shortfall(worker):
        short = memory_shortfall(worker, 2 * FIT_MARGIN_BYTES)
    group, _ = worker.executor.ctx.parallel.moe_group
    if group.tp_size == 1:
        return short
    mine = torch.tensor([short], dtype=torch.int64, device=worker.device)
    return int(group.all_gather(mine).max())


FIT_ROUNDS = 3  # captures after the first at most: each measures what is short anew


def fit_kv_cache(worker: StepWorker, short: int | None = None) -> None:
    """Where the graphs and the warm-up left less free than the largest step needs on
    any rank (`agreed_shortfall`, or `short` bytes as given for the first round),
    shrink the KV cache by the shortfall and capture its graphs again; measure again,
    up to FIT_ROUNDS times (a new capture takes about what the old one gave back, a
    little more where NCCL or cuBLAS keep what the first took). Nothing may be in
    flight; `check_largest_step_fits` judges what is left."""
    ex, drafter, args = worker.executor, worker.drafter, worker.args
    draft = drafter.cfg.layer if drafter is not None else None
    per_page = kv_page_bytes(
        args, worker.cfg, args.kv_dtype(ex.dtype), ex.ctx.parallel.tp_size, draft
    )
    for _ in range(FIT_ROUNDS):
        short = agreed_shortfall(worker) if short is None else short
        if not short:
            return
        assert ex.kv_cache is not None, "fit an allocated KV cache"
        old = ex.kv_cache.num_pages
        pages = pages_for_shortfall(old, short, per_page)
        logger.info(
            "KV cache %d -> %d pages: the graphs left %.2f GiB less free than the largest "
            "step needs", old, pages, short / (1 << 30),
        )  # fmt: skip
        context = min(worker.max_model_len, max_model_len(args, worker.cfg, pages))
        worker.release_kv_cache()
        gc.collect()  # NOTE: graphs and caches go with their last reference
        if worker.device.type == "cuda":
            torch.cuda.empty_cache()
        worker.init_kv_cache(pages, context)
        short = None


def check_largest_step_fits(worker: StepWorker, context_len: int) -> None:
    """The warm-up's last step: the profile's steps beside the real KV cache and graphs.
    Raises RuntimeError (what to change) where they do not fit: before running them
    where the free memory is already short of the measured peak (`worker.step_peak`;
    a rank that stops there runs no collective the others could wait in), else where
    they run out of memory."""
    args = worker.args
    what = f"the largest step ({args.max_num_batched_tokens} tokens, {args.max_num_seqs} rows)"
    fix = "lower --mem-fraction, --kv-cache-memory or --num-kv-pages, or --max-num-batched-tokens"
    short = memory_shortfall(worker)
    if short:
        gib = 1 << 30
        need = worker.step_peak + FIT_MARGIN_BYTES
        raise RuntimeError(
            f"{what} needs {need / gib:.2f} GiB; {(need - short) / gib:.2f} GiB are "
            f"free beside the KV cache and graphs: {fix}"
        )
    try:
        run_profile_steps(worker, context_len)
    except torch.OutOfMemoryError as e:
        raise RuntimeError(f"{what} does not fit beside the KV cache: {fix}") from e
    finally:
        torch.cuda.empty_cache()
