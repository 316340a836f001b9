"""Tensor-parallel test helpers: ranks as threads of one process (an in-process
communicator), ranks as spawned processes over gloo (a harness that never hangs),
and the tiny model and prefill batch both kinds of rank run."""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing as mp
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait

import torch

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.distributed import destroy_distributed, init_tensor_parallel
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import RowInput, build_batch_tensors
from gyrfalcon.forward.parallel import ParallelContext
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


# ---- what the gloo tests' ranks run -----------------------------------------------

# NOTE: bounds every rendezvous and collective of a test rank: a rank whose peer died
# raises within it instead of hanging (spawn_ranks' deadline is above it)
COLLECTIVE_TIMEOUT = timedelta(seconds=20)


def join_ranks(
    rank: int, world_size: int, init_addr: str, tp_size: int, ep_size: int = 1
) -> ParallelContext:
    """This rank's place in TP groups of tp_size over the world (`init_tensor_parallel`
    on the CPU, every collective bounded by COLLECTIVE_TIMEOUT)."""
    return init_tensor_parallel(
        rank, world_size, tp_size, init_addr, CPU, COLLECTIVE_TIMEOUT, ep_size=ep_size
    )


def rank_checks_collectives(
    rank: int, world_size: int, init_addr: str, out_dir: str, tp_size: int
) -> None:
    """Join TP group rank // tp_size; check its all-reduce and all-gather sum and join
    the group's members only (rank m contributes tensors made from m)."""
    parallel = join_ranks(rank, world_size, init_addr, tp_size)
    assert (parallel.tp_rank, parallel.tp_size) == (rank % tp_size, tp_size)
    first = rank - rank % tp_size
    members = range(first, first + tp_size)
    x = torch.full((2, 3), float(rank + 1))
    total = float(sum(m + 1 for m in members))
    assert torch.equal(parallel.all_reduce(x), torch.full((2, 3), total))
    for shape in [(5,), (2, 3), (2, 3, 4)]:

        def part(m: int, shape=shape) -> torch.Tensor:
            return torch.arange(float(math.prod(shape))).reshape(shape) + 100 * m

        want = torch.cat([part(m) for m in members], dim=-1)
        assert torch.equal(parallel.all_gather(part(rank)), want), shape
    comm = parallel.comm
    if comm is None:
        return
    check_rows_collectives(comm, rank % tp_size, tp_size)
    comm.one_shot = _RowsThroughGroup(comm.group)  # the one-shot branch: the same results
    check_rows_collectives(comm, rank % tp_size, tp_size)
    assert comm.one_shot.calls == ["gather", "scatter", "scatter"], comm.one_shot.calls


class _RowsThroughGroup:
    """A stand-in on the CPU for the one-shot's rows kernels (CUDA only): the group's
    gather and reduce-scatter, each call recorded."""

    def __init__(self, group):
        self.group, self.calls = group, []

    def rows_fit(self, part: torch.Tensor) -> bool:
        return True

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        from gyrfalcon.forward.distributed import _all_gather_single

        self.calls.append("gather")
        out = x.new_empty((self.group.size() * x.shape[0], *x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        from gyrfalcon.forward.distributed import _reduce_scatter_single

        self.calls.append("scatter")
        out = x.new_empty((x.shape[0] // self.group.size(), *x.shape[1:]))
        _reduce_scatter_single(out, x.contiguous(), group=self.group)
        return out


def check_rows_collectives(comm, rank: int, size: int) -> None:
    """The rows' gather (rank r brings r + 1 rows: each padded to `size`; then equal
    rows, as graphs gather) and the reduce-scatter, against what they must give."""
    h = 3

    def rows(m: int, n: int) -> torch.Tensor:
        return torch.arange(float(n * h)).reshape(n, h) + 100 * m + 1

    comm.equal_rows = False
    got, counts = comm.all_gather_rows(rows(rank, rank + 1))
    assert counts == [m + 1 for m in range(size)]
    padded = [torch.cat([rows(m, m + 1), torch.zeros(size - m - 1, h)]) for m in range(size)]
    assert torch.equal(got, torch.cat(padded))
    comm.equal_rows = True
    got, counts = comm.all_gather_rows(rows(rank, 2))
    assert counts == [2] * size and torch.equal(got, torch.cat([rows(m, 2) for m in range(size)]))
    comm.equal_rows = False
    for n in (1, 4):
        x = torch.cat([rows(rank, n) * (b + 1) for b in range(size)])  # block b for rank b
        want = sum(rows(m, n) for m in range(size)) * (rank + 1)
        assert torch.equal(comm.reduce_scatter(x), want), n


def save_rank(out_dir: str, rank: int, out: dict) -> None:
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def rank_tp_logits(
    rank: int,
    world_size: int,
    init_addr: str,
    out_dir: str,
    model_dirs: dict[str, str],
    prompts: list[list[int]],
) -> None:
    """One TP group of all ranks: load each checkpoint with this rank's share, prefill
    the prompts and save {name: {"hidden", "logits", "embed_rows"}} to rank{r}.pt."""
    ctx = LayerContext(parallel=join_ranks(rank, world_size, init_addr, world_size))
    out = {}
    for name, model_dir in model_dirs.items():
        model, out[name] = prefill_logits(model_dir, ctx, prompts)
        out[name]["embed_rows"] = model.embed_tokens.weight.shape[0]
    save_rank(out_dir, rank, out)


def rank_moe_logits(
    rank: int,
    world_size: int,
    init_addr: str,
    out_dir: str,
    model_dirs: dict[str, str],
    prompts: list[list[int]],
) -> None:
    """One TP group of all ranks; for each checkpoint and each MoE sharding ("tp":
    ep_size 1, "ep": ep_size = the group), load this rank's share, prefill the prompts
    and save {(name, mode): {"hidden", "logits", "w13"}} to rank{r}.pt (w13: the
    shape of the last layer's experts here). Also {"rows": {"x", "moe"}}: the last
    checkpoint's last MoE block under EP on rank-local tokens x (DP attention's
    dispatch: rank r brings 3 r + 2 rows, rank 1 none), and {"rows_equal": ...} the
    same with 4 rows on every rank gathered as graphs do (`equal_rows`)."""
    from dataclasses import replace

    parallel = join_ranks(rank, world_size, init_addr, world_size, ep_size=world_size)
    assert parallel.ep_size == world_size
    out: dict = {}
    for name, model_dir in model_dirs.items():
        for mode, sharding in (("tp", replace(parallel, ep_size=1)), ("ep", parallel)):
            model, out[name, mode] = prefill_logits(
                model_dir, LayerContext(parallel=sharding), prompts
            )
            out[name, mode]["w13"] = tuple(model.layers[-1].mlp.experts.w13.shape)
    rows = 0 if rank == 1 else 3 * rank + 2
    x = torch.randn(rows, model.cfg.hidden_size, generator=torch.Generator().manual_seed(rank))
    out["rows"] = dict(x=x, moe=model.layers[-1].mlp(x, tokens_local=True))
    # graphs' gather: every rank brings 4 rows, no host exchange of counts
    x = torch.randn(4, model.cfg.hidden_size, generator=torch.Generator().manual_seed(9 + rank))
    if parallel.comm is not None:
        parallel.comm.equal_rows = True
    out["rows_equal"] = dict(x=x, moe=model.layers[-1].mlp(x, tokens_local=True))
    save_rank(out_dir, rank, out)


def rank_dp_attention_logits(
    rank: int,
    world_size: int,
    init_addr: str,
    out_dir: str,
    model_dir: str,
    tp_size: int,
    prompts: list[list[list[int]]],
    agreed_prompts: list[list[list[int]]],
) -> None:
    """DP attention: DP groups of tp_size ranks, the MoE experts split over every rank
    of the world (ep_size = world_size). Rank r prefills its DP group's prompts
    (`prompts[r // tp_size]`, the groups' token counts differing), then its group's
    `agreed_prompts` (the same count in every group) under `rows_agreed` (graphs'
    gather: no count exchange), and saves {"own" | "agreed": {"hidden", "logits"},
    "w13": the shape of the last layer's experts here} to rank{r}.pt."""
    parallel = join_ranks(rank, world_size, init_addr, tp_size, ep_size=world_size)
    assert parallel.tp_size == tp_size and parallel.moe_group[1], parallel
    ctx = LayerContext(parallel=parallel)
    model = load_model(model_dir, ctx)
    out: dict = {"w13": tuple(model.layers[-1].mlp.experts.w13.shape)}
    group = rank // tp_size
    for name, by_group in (("own", prompts), ("agreed", agreed_prompts)):
        rows = parallel.rows_agreed() if name == "agreed" else contextlib.nullcontext()
        with rows:
            hidden = model(prefill_batch(model, by_group[group], ctx))  # [T, hidden]
        out[name] = dict(hidden=hidden, logits=model.compute_logits(hidden))
    save_rank(out_dir, rank, out)


def rank_outlives_its_peer(rank: int, world_size: int, init_addr: str, out_dir: str) -> None:
    """Rank 1 vanishes after the groups are built (as if killed); rank 0's all-reduce
    must raise, not hang: rank 0 saves the error and how long it took to peer.json."""
    parallel = join_ranks(rank, world_size, init_addr, world_size)
    if rank == 1:
        os._exit(0)  # NOTE: no cleanup, no goodbye: the peer just disappears
    start = time.monotonic()
    try:
        parallel.all_reduce(torch.ones(4))
    except Exception as e:  # gloo's error on a closed connection or on the timeout
        seconds = time.monotonic() - start
        with open(os.path.join(out_dir, "peer.json"), "w") as f:
            json.dump({"error": f"{type(e).__name__}: {e}", "seconds": seconds}, f)
        return
    raise AssertionError("all-reduce returned without its peer")


def rank_fails_while_peer_waits(rank: int, world_size: int, init_addr: str, out_dir: str) -> None:
    """Rank 1 raises after the groups are built; rank 0 waits in an all-reduce."""
    parallel = join_ranks(rank, world_size, init_addr, world_size)
    if rank == 1:
        raise ValueError("rank 1 fails")
    parallel.all_reduce(torch.ones(4))
