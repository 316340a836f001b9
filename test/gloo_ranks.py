"""What the gloo tests' spawned ranks run (`parallel_util.spawn_ranks` starts them;
spawned ranks import these by name): TP, MoE and DP-attention logits, the
communicator's collectives and rows, and ranks that fail or vanish beside a waiting
peer."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from datetime import timedelta

import torch
from parallel_util import CPU, load_model, prefill_batch, prefill_logits

from gyrfalcon.forward.distributed import init_tensor_parallel
from gyrfalcon.forward.parallel import ParallelContext
from gyrfalcon.layers.context import LayerContext

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
    check_kept_counts(comm, rank % tp_size, tp_size)
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


def check_kept_counts(comm, rank: int, size: int) -> None:
    """`keep_counts` (one eager forward, `ParallelContext.counts_once`): the counts the
    first gather exchanged serve the next one; a gather of other counts then fails on
    every rank before any collective (proof that nothing was asked); setting it again
    (the next forward) drops the kept counts, and they are asked afresh."""
    comm.keep_counts = True
    try:
        for _ in range(2):
            got, counts = comm.all_gather_rows(torch.ones(rank + 1, 3))
            assert counts == [m + 1 for m in range(size)] and got.shape == (size * size, 3)
        try:
            comm.all_gather_rows(torch.ones(rank + 2, 3))
            raise RuntimeError("kept counts did not guard a gather of other counts")
        except AssertionError:
            pass
        comm.keep_counts = True
        _, counts = comm.all_gather_rows(torch.ones(rank + 2, 3))
        assert counts == [m + 2 for m in range(size)], counts
    finally:
        comm.keep_counts = False


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
    (`prompts[r // tp_size]`, the groups' token counts differing), the same again under
    `counts_once` (an eager forward's: the counts exchanged by the first MoE layer
    only), then its group's `agreed_prompts` (the same count in every group) under
    `rows_agreed` (graphs' gather: no count exchange), and saves {"own" | "counted" |
    "agreed": {"hidden", "logits", "exchanges": the row-count exchanges it made},
    "w13": the shape of the last layer's experts here} to rank{r}.pt."""
    parallel = join_ranks(rank, world_size, init_addr, tp_size, ep_size=world_size)
    assert parallel.tp_size == tp_size and parallel.moe_group[1], parallel
    ctx = LayerContext(parallel=parallel)
    model = load_model(model_dir, ctx)
    out: dict = {"w13": tuple(model.layers[-1].mlp.experts.w13.shape)}
    group = rank // tp_size
    scopes = {"own": contextlib.nullcontext, "counted": parallel.counts_once}
    for name, by_group in (("own", prompts), ("counted", prompts), ("agreed", agreed_prompts)):
        with scopes.get(name, parallel.rows_agreed)(), _count_exchanges() as exchanges:
            hidden = model(prefill_batch(model, by_group[group], ctx))  # [T, hidden]
        out[name] = dict(hidden=hidden, logits=model.compute_logits(hidden), exchanges=exchanges[0])
    save_rank(out_dir, rank, out)


@contextlib.contextmanager
def _count_exchanges():
    """[the row-count all-gathers made inside] (the int64 ones: rows are floats)."""
    from gyrfalcon.forward import distributed

    made, gather = [0], distributed._all_gather_single

    def counting(out: torch.Tensor, x: torch.Tensor, **kw) -> None:
        made[0] += out.dtype == torch.int64
        gather(out, x, **kw)

    distributed._all_gather_single = counting
    try:
        yield made
    finally:
        distributed._all_gather_single = gather


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
