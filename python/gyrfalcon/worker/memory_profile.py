"""The largest step's activation memory, measured before the KV cache is sized.

KV sizing (kv_sizing.py) gives the weights and the KV cache --mem-fraction of the
device; the rest must hold the activations of the largest step the scheduler can plan.
That step can be large: under DP attention with expert parallelism every MoE layer
gathers the tokens of every DP group (dp x --max-num-batched-tokens of them), and with
EAGLE3 every row of a VERIFY step scores k + 1 tokens over the whole vocabulary. So
before sizing, every rank runs the worst-case steps (`warmup.profile_batches`, through
the same path as the scheduler's) eagerly on a KV cache of two pages, and the memory
they allocate at peak stays free beside the KV cache (`kv_sizing.kv_budget`). The
warm-up runs them once more beside the real KV cache and graphs (`run_profile_steps`):
a server whose largest step does not fit fails at start-up with a clear message, not
at its first burst of requests.

On the CPU nothing is measured (torch keeps no peak there and KV sizing has its own
cap); the steps themselves run on any device, which is how the CPU tests cover them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from gyrfalcon.worker.warmup import profile_batches

if TYPE_CHECKING:
    from gyrfalcon.worker.step_worker import StepWorker

logger = logging.getLogger(__name__)

PROFILE_PAGES = 2  # the dummy page and one more: the profile's rows use the dummy page only


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
    """Bytes the largest steps allocate at peak on `worker`'s CUDA device, beyond what is
    resident (weights); 0 on other devices, where the steps run unmeasured. Call before
    `init_kv_cache`: it allocates a KV cache of PROFILE_PAGES pages (the drafter's too),
    runs the steps eagerly (no graphs yet) and frees the cache again."""
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
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
    try:
        run_profile_steps(worker, context_len)
        if not cuda:
            return 0
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - base
    finally:
        ex.kv_cache = None
        if drafter is not None:
            drafter.kv_cache = None
        worker.max_model_len = 0
        if cuda:
            torch.cuda.empty_cache()


def check_largest_step_fits(worker: StepWorker, context_len: int) -> None:
    """The warm-up's last step: the profile's steps beside the real KV cache and graphs.
    Raises RuntimeError (what to change) where they do not fit: before running them
    where the free memory is already short of the measured peak (`worker.step_peak`;
    a rank that stops there runs no collective the others could wait in), else where
    they run out of memory."""
    args = worker.args
    what = f"the largest step ({args.max_num_batched_tokens} tokens, {args.max_num_seqs} rows)"
    fix = "lower --mem-fraction, --kv-cache-memory or --num-kv-pages, or --max-num-batched-tokens"
    if worker.step_peak:
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(worker.device)
        if free < worker.step_peak:
            gib = 1 << 30
            raise RuntimeError(
                f"{what} needs {worker.step_peak / gib:.2f} GiB; {free / gib:.2f} GiB are "
                f"free beside the KV cache and graphs: {fix}"
            )
    try:
        run_profile_steps(worker, context_len)
    except torch.OutOfMemoryError as e:
        raise RuntimeError(f"{what} does not fit beside the KV cache: {fix}") from e
    finally:
        torch.cuda.empty_cache()
