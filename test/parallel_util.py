"""Tensor-parallel test helpers: ranks as threads of one process (an in-process
communicator), ranks as spawned processes over gloo (a harness that never hangs; what
they run is in gloo_ranks.py), and the tiny model and prefill batch both kinds of rank
run."""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import wait

import torch

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.distributed import destroy_distributed
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import RowInput, build_batch_tensors
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.torch_ref import TorchRefBackend
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.models.registry import build_model

CPU = torch.device("cpu")
PAGE = 4


def load_model(model_dir: str, ctx: LayerContext) -> torch.nn.Module:
    """The checkpoint's model in float32 on the CPU, built with ctx (its rank's share)."""
    cfg = ModelConfig.from_dir(model_dir)
    return build_model(cfg, model_dir, torch.float32, CPU, ctx, show_progress=False)


def prefill_batch(model, prompts: list[list[int]], ctx: LayerContext) -> ForwardBatch:
    """A PREFILL batch of the prompts (fresh requests) over a new KV cache and torch_ref
    backend holding ctx's heads."""
    cfg = model.cfg
    heads = ctx.parallel.heads(cfg.num_heads, cfg.num_kv_heads)
    backend = TorchRefBackend(heads.num_heads, heads.num_kv_heads, cfg.head_dim, cfg.head_dim**-0.5)
    rows, next_page = [], 1  # page 0 is the dummy page
    for ids in prompts:
        n = -(-len(ids) // PAGE)
        rows.append(RowInput(0, ids, list(range(next_page, next_page + n))))
        next_page += n
    cache = KVCache(
        cfg.num_layers, next_page, PAGE, heads.num_kv_heads, cfg.head_dim, torch.float32, CPU
    )
    bt = build_batch_tensors(rows, PAGE, CPU)
    batch = ForwardBatch.from_tensors(ForwardMode.PREFILL, bt, PAGE, cache, backend)
    batch.attn_meta = backend.build_metadata(batch)
    return batch


def prefill_logits(
    model_dir: str, ctx: LayerContext, prompts: list[list[int]]
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """Load model_dir's share for ctx and prefill the prompts: (the model, {"hidden"
    [T, hidden], "logits" [T, vocab]}); one rank's reference with the default ctx."""
    model = load_model(model_dir, ctx)
    hidden = model(prefill_batch(model, prompts, ctx))
    return model, dict(hidden=hidden, logits=model.compute_logits(hidden))


# ---- ranks as threads -------------------------------------------------------------


class ThreadGroup:
    """The collectives of a TP group whose ranks are threads: every rank gets the same
    result (an all-reduce adds the parts in rank order, so the same bits everywhere)."""

    def __init__(self, size: int):
        self.parts: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=120)

    def member(self, rank: int) -> ThreadGroupMember:
        return ThreadGroupMember(self, rank)

    def exchange(self, rank: int, x: torch.Tensor, combine) -> torch.Tensor:
        self.parts[rank] = x
        self.barrier.wait()  # every rank's part is in
        out = combine(self.parts)
        self.barrier.wait()  # every rank has read the parts: the next call may overwrite
        return out


class ThreadGroupMember:
    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank = group, rank
        self.equal_rows = False  # NOTE: the parts carry their counts either way
        self.keep_counts = False

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        def add(parts: list[torch.Tensor]) -> torch.Tensor:
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            return total

        return self.group.exchange(self.rank, x, add)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.exchange(self.rank, x, lambda parts: torch.cat(parts, dim=-1))

    def all_gather_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        def rows(parts: list[torch.Tensor]) -> tuple[torch.Tensor, list[int]]:
            most = max(p.shape[0] for p in parts)
            padded = [torch.cat([p, p.new_zeros(most - p.shape[0], *p.shape[1:])]) for p in parts]
            return torch.cat(padded), [p.shape[0] for p in parts]

        return self.group.exchange(self.rank, x, rows)

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0] // len(self.group.parts)
        return self.all_reduce(x)[self.rank * n : (self.rank + 1) * n].clone()


def run_ranks(fn: Callable[[int], object], tp: int) -> list:
    """fn(rank) in tp threads at once, under inference mode; their results in rank
    order (re-raises the first error)."""
    results: list = [None] * tp
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            with torch.inference_mode():
                results[rank] = fn(rank)
        except BaseException as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


# ---- ranks as processes (gloo) ----------------------------------------------------

# what each spawned rank may run (a test names one): fn(rank, world_size, init_addr,
# out_dir, *args), writing what the test checks under out_dir
RankFn = Callable[..., None]


def spawn_ranks(fn: RankFn, world_size: int, out_dir: str, *args, timeout_s: float) -> None:
    """Run fn on world_size spawned ranks that meet at a free local port. Waits at most
    timeout_s for all; as soon as one fails, or at the deadline, kills the others (no
    rank is left behind, none can hang the test), then raises with the failing
    ranks' tracebacks."""
    from gyrfalcon.utils import free_port

    init_addr = f"tcp://127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, init_addr, out_dir, args),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    pending = {p.sentinel: p for p in procs}
    deadline = time.monotonic() + timeout_s
    failed = False
    try:
        while pending and not failed and (left := deadline - time.monotonic()) > 0:
            for sentinel in wait(list(pending), timeout=left):
                p = pending.pop(sentinel)
                p.join()
                failed |= p.exitcode != 0
    finally:
        for p in pending.values():
            p.kill()
            p.join()
    errors = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.err")
        if os.path.exists(path):
            with open(path) as f:
                errors.append(f"rank {rank}:\n{f.read()}")
    codes = {p.name: p.exitcode for p in procs if p not in pending.values()}
    if pending:
        names = [p.name for p in pending.values()]
        why = "killed after a rank failed" if failed else f"still running after {timeout_s} s"
        errors.append(f"{names} {why}")
    if errors or any(codes.values()):
        raise AssertionError("\n".join([f"rank exit codes {codes}", *errors]))


def _rank_main(
    fn: RankFn, rank: int, world_size: int, init_addr: str, out_dir: str, args: tuple
) -> None:
    torch.set_num_threads(1)  # NOTE: ranks share the CI machine's few cores
    try:
        with torch.inference_mode():
            fn(rank, world_size, init_addr, out_dir, *args)
    except BaseException:
        text = traceback.format_exc()
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(text)
        sys.stderr.write(text)
        sys.stderr.flush()
        # NOTE: no process-group teardown: with peers inside a collective NCCL's can
        # block (a failed rank on four H100s never exited, and its test ran to the
        # deadline without its traceback); spawn_ranks kills the others
        os._exit(1)
    destroy_distributed()
