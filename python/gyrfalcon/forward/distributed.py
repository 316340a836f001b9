"""torch.distributed behind the layers' collectives: the `Communicator` of one TP
group over a process group, and the start of a rank's process groups.

Every rank of the world calls `init_tensor_parallel` with the same sizes, address and
timeout; it joins the default process group (gloo on the CPU, NCCL on CUDA) and
builds the TP groups: ranks [k tp, (k + 1) tp) form group k, so rank r is TP rank
r % tp of DP group r // tp (`ipc/contract.RankLayout`). The timeout bounds every
collective: a rank whose peer died gets an error, never a hang.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from gyrfalcon.forward.one_shot import OneShotAllReduce, one_shot_for
from gyrfalcon.forward.parallel import ParallelContext

# NOTE: torch 2.13 deprecates all_gather_into_tensor for all_gather_single (the same
# call); the GPU machine's torch 2.11 may have only the former.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# NOTE: where the one-shot kernels beat NCCL (benchmarks/bench_all_reduce.py on two H100s,
# inside graphs, 2fd852e: 2.4 against 6.7 us at 8 KiB, 3.2 against 7.4 at 128 KiB, 3.9
# against 8.8 at 256 KiB): sums up to ONE_SHOT_MAX_BYTES, the most the kernel takes in
# bf16; the sum fused with the add + RMSNorm after it (which saves the norm's own launch)
# up to FUSED_MAX_ROWS rows
ONE_SHOT_MAX_BYTES = 256 << 10
FUSED_MAX_ROWS = 16


class GroupCommunicator:
    """The collectives of one TP group (`forward/parallel.Communicator`) over a
    torch.distributed process group of `size` ranks; small all-reduces through
    `one_shot` when given (`forward/one_shot.py`), the rest through the group. With a
    one-shot built with its rows kernels (DP attention's world), the equal-rows
    gathers (the graphs') and the reduce-scatters of up to a buffer half per rank go
    through them (one PDL launch each, against NCCL's ~15-30 us and its break of the
    launch chain)."""

    def __init__(
        self, group: dist.ProcessGroup, size: int, one_shot: OneShotAllReduce | None = None
    ):
        self.group, self.size, self.one_shot = group, size, one_shot
        self.rank = dist.get_rank(group)
        # every rank brings the same number of rows (`ParallelContext.rows_agreed`)
        self.equal_rows = False
        # one eager forward's row counts, asked once (`ParallelContext.counts_once`)
        self._keep, self._kept_counts = False, None

    @property
    def keep_counts(self) -> bool:
        return self._keep

    @keep_counts.setter
    def keep_counts(self, on: bool) -> None:
        """Either way the counts kept so far go: they were another forward's."""
        self._keep, self._kept_counts = on, None

    def _one_shot_for(self, x: torch.Tensor) -> OneShotAllReduce | None:
        """The one-shot sum where it takes x, else None (NCCL)."""
        # NOTE: every rank decides alike: the same shapes and dtype on every rank
        one_shot = self.one_shot
        if one_shot is None or x.numel() * x.element_size() > ONE_SHOT_MAX_BYTES:
            return None
        return one_shot if one_shot.fits(x) else None

    def _rows_one_shot_for(self, part: torch.Tensor) -> OneShotAllReduce | None:
        """The one-shot's rows kernels where they take a rank's part like `part`."""
        # NOTE: every rank decides alike: the same shapes and dtype on every rank
        one_shot = self.one_shot
        return one_shot if one_shot is not None and one_shot.rows_fit(part) else None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group, in x's storage (x must be contiguous)."""
        if (one_shot := self._one_shot_for(x)) is not None:
            return one_shot(x)
        dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The sum over the group fused with the residual add and RMSNorm after it
        (`ParallelContext.reduce_add_rmsnorm`), or None without a one-shot kernel for x."""
        if self.one_shot is None or x.dim() != 2 or x.shape[0] > FUSED_MAX_ROWS:
            return None
        return self.one_shot.add_rmsnorm(x, residual, weight, eps)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., n] of every rank concatenated in rank order: [..., size * n]."""
        assert x.dim() >= 1, "all_gather concatenates along the last dim"
        x = x.contiguous()
        stacked = x.new_empty((self.size * x.shape[0], *x.shape[1:]))  # ranks along dim 0
        _all_gather_single(stacked, x, group=self.group)
        # [size, ..., n] -> [..., size, n] -> [..., size * n]
        ranks_last = stacked.view(self.size, *x.shape).movedim(0, -2)
        return ranks_last.reshape(*x.shape[:-1], self.size * x.shape[-1])

    def all_gather_rows(self, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """(x [n_r, ...] of every rank padded with zero rows to the most rows R of any
        rank, in rank order: [size R, ...], [n_r]): the counts are gathered first (a host
        sync), then the padded rows in one all-gather. With `equal_rows` the counts are
        known (this rank's on every rank): one all-gather, host-free, CUDA graphs capture
        it. With `keep_counts` the first call's counts serve every later call until it
        is cleared: one sync a forward instead of one a MoE layer."""
        x = x.contiguous()
        if self.equal_rows:
            n = x.shape[0]
            if (one_shot := self._rows_one_shot_for(x)) is not None:
                return one_shot.gather(x), [n] * self.size
            stacked = x.new_empty((self.size * n, *x.shape[1:]))
            _all_gather_single(stacked, x, group=self.group)
            return stacked, [n] * self.size
        counts = self._kept_counts
        if counts is None:
            count = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
            counts_t = count.new_empty(self.size)
            _all_gather_single(counts_t, count, group=self.group)
            counts = counts_t.tolist()
            self._kept_counts = counts if self._keep else None
        # NOTE: a kept count that no longer fits would gather wrong rows on every rank
        assert counts[self.rank] == x.shape[0], (counts, self.rank, x.shape)
        rows = max(counts)
        padded = x
        if x.shape[0] < rows:
            padded = x.new_zeros((rows, *x.shape[1:]))
            padded[: x.shape[0]] = x
        stacked = x.new_empty((self.size * rows, *x.shape[1:]))  # rank r at [r rows, ...)
        _all_gather_single(stacked, padded, group=self.group)
        return stacked, counts

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's block [n, ...] of the sum over the group of x [size n, ...]."""
        x = x.contiguous()
        assert x.shape[0] % self.size == 0, (x.shape, self.size)
        n = x.shape[0] // self.size
        if (one_shot := self._rows_one_shot_for(x[:n])) is not None:
            return one_shot.reduce_scatter(x)
        out = x.new_empty((n, *x.shape[1:]))
        _reduce_scatter_single(out, x, group=self.group)
        return out


def backend_for(device: torch.device) -> str:
    """The process-group backend of a device: NCCL on CUDA, gloo on the CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_tensor_parallel(
    rank: int,
    world_size: int,
    tp_size: int,
    init_addr: str,
    device: torch.device,
    timeout: timedelta,
    ep_size: int = 1,
    custom_all_reduce: bool = False,
    pdl: bool = True,
    world_one_shot: bool = False,
) -> ParallelContext:
    """Join the default process group as `rank` of `world_size` through `init_addr`
    ("tcp://host:port", rank 0's store), build every TP group of `tp_size`
    consecutive ranks, and return this rank's `ParallelContext`. Its MoE layers split
    experts over the TP group when `ep_size` is tp_size (`ParallelContext.ep_size`),
    or over every rank of the world when `ep_size` is world_size and the world holds
    several DP groups (DP attention: `ParallelContext.expert`, the world group).
    Every rank calls it with the same arguments but its rank; `timeout` bounds the
    rendezvous and every collective. `custom_all_reduce`: the TP group's small
    all-reduces go through one Triton launch over symmetric memory on CUDA
    (`forward/one_shot.py`; `pdl`: it may launch with programmatic dependent launch);
    `world_one_shot`: the same for the world group of DP attention's experts, with its
    row gather and reduce-scatter (every rank on one node). `destroy_distributed`
    undoes it."""
    if not init_addr.startswith("tcp://"):
        raise ValueError(f"init address {init_addr!r} is not tcp://host:port")
    if tp_size < 1 or world_size % tp_size:
        raise ValueError(f"tp size {tp_size} does not divide the world of {world_size} ranks")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of {world_size}")
    if ep_size not in (1, tp_size, world_size):
        raise ValueError(
            f"ep size {ep_size} is neither 1, the tp size {tp_size} nor the world size {world_size}"
        )
    dp_attention = ep_size == world_size > tp_size
    extra = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        extra["device_id"] = device  # NOTE: NCCL binds the rank's GPU now, not lazily
        # NOTE: NCCL's heartbeat monitor polls rank 0's store and prints a stack trace
        # when rank 0 ends first at shutdown; the collectives' own timeout already
        # bounds every hang (the launcher's liveness checks end the server)
        os.environ.setdefault("TORCH_NCCL_ENABLE_MONITORING", "0")
    dist.init_process_group(
        backend_for(device),
        init_method=init_addr,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        **extra,
    )
    expert = None
    if dp_attention:  # NOTE: experts over the whole world, each rank with its own tokens
        whole = dist.group.WORLD
        world_sums = one_shot_for(whole, device, pdl, rows=True) if world_one_shot else None
        world = GroupCommunicator(whole, world_size, world_sums)
        expert = ParallelContext(rank, world_size, world, ep_size=world_size)
    if tp_size == 1:
        return ParallelContext(expert=expert)
    mine = None
    for first in range(0, world_size, tp_size):
        # NOTE: new_group is collective over the world: every rank builds every group,
        # in the same order, and keeps its own
        ranks = list(range(first, first + tp_size))
        group = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    assert mine is not None
    one_shot = one_shot_for(mine, device, pdl) if custom_all_reduce else None
    comm = GroupCommunicator(mine, tp_size, one_shot)
    return ParallelContext(rank % tp_size, tp_size, comm, 1 if dp_attention else ep_size, expert)


def destroy_distributed() -> bool:
    """Destroy every process group of this process; whether there were any."""
    if not dist.is_initialized():
        return False
    dist.destroy_process_group()
    return True
