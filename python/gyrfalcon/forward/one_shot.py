"""The TP group's small all-reduces in one Triton launch over symmetric memory (CUDA).

A TP decode step all-reduces two activations a layer of a few KiB each. NCCL spends
~15 us on each, and its kernel ends the chain of programmatic dependent launches: the
kernels on both sides of it start cold. `kernels/all_reduce.py` is a one-shot sum in
one PDL launch; this module gives it what every rank must share: a receive buffer
each rank's peers can write (torch's symmetric memory, NVLink P2P, no multicast),
zeroed on every rank before first use.

Larger tensors (prefill chunks, big batches) stay with NCCL: the one-shot sends every
peer the whole tensor, with a flag in every word. `--disable-custom-all-reduce` turns
it off; `available` says whether this machine's torch and GPUs support it.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def available(device: torch.device) -> bool:
    """Whether symmetric memory can be used on this device (CUDA, torch with symm_mem)."""
    if device.type != "cuda":
        return False
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return True


class _Exchange:
    """One kernel's shared state over the group: a receive buffer every rank can write
    (two halves of a slot per sender) and this rank's counts of calls per program."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, half_elems: int):
        import torch.distributed._symmetric_memory as symm_mem

        from gyrfalcon.kernels.all_reduce import MAX_PROGRAMS, buffer_words

        words = buffer_words(group.size(), half_elems)
        self.buffer = symm_mem.empty(words, dtype=torch.int64, device=device)
        self.buffer.zero_()
        self.uses = torch.zeros(MAX_PROGRAMS, dtype=torch.int64, device=device)
        handle = symm_mem.rendezvous(self.buffer, group.group_name)
        self.rank = handle.rank
        self.buf_ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)

    def args(self) -> tuple:
        return self.buf_ptrs, self.uses, self.rank


class OneShotAllReduce:
    """The one-shot sum over `group` of contiguous tensors of `DTYPES` up to `half_elems`
    elements, and the same sum fused with the residual add and RMSNorm after it for
    decode-sized rows (`add_rmsnorm`). Every rank of the group builds it at the same
    point (the rendezvous is collective)."""

    def __init__(
        self, group: dist.ProcessGroup, device: torch.device, pdl: bool, rows: bool = False
    ):
        # NOTE: triton imported here, not with this module: the CPU tests set the
        # interpreter up before their first triton import
        from gyrfalcon.kernels import all_reduce, rows_exchange

        self.kernels, self.rows_kernels, self.pdl = all_reduce, rows_exchange, pdl
        self.half_elems = all_reduce.MAX_PROGRAMS * all_reduce.CHUNK  # the largest it sums
        # NOTE: each kernel its own state: a program's part must sit at one place in
        # every call that advances its count (kernels/all_reduce.py)
        self.sum = _Exchange(group, device, self.half_elems)
        self.norm = _Exchange(group, device, self.half_elems)
        # rows: DP attention's gather and reduce-scatter too (kernels/rows_exchange.py)
        self.rows = rows
        if rows:
            self.gathers = _Exchange(group, device, self.half_elems)
            self.scatters = _Exchange(group, device, self.half_elems)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # NOTE: every rank's buffer is zero before any call

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype in DTYPES and 0 < x.numel() <= self.half_elems and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group, written into x (`fits`)."""
        return self.kernels.one_shot_all_reduce(
            x, x, *self.sum.args(), self.half_elems, pdl=self.pdl
        )

    def add_rmsnorm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rmsnorm(s + residual), s + residual) in place (x, residual) where s is the
        sum of x over the group, in one launch; None where the kernel does not take x
        (the caller sums, then adds and norms). Every rank decides alike."""
        if x.dtype not in DTYPES or not self.kernels.add_rmsnorm_fits(x, self.half_elems):
            return None
        return self.kernels.one_shot_add_rmsnorm(
            x, residual, weight, eps, *self.norm.args(), self.half_elems,
            pdl=self.pdl,
        )  # fmt: skip

    def rows_fit(self, part: torch.Tensor) -> bool:
        """Whether `gather` and `reduce_scatter` take a rank's part like `part` (its
        rows, or one block): built with `rows`, a dtype of DTYPES, within a half."""
        return (
            self.rows
            and part.dtype in DTYPES
            and self.rows_kernels.rows_fit(part.numel(), self.half_elems)
        )

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [m, ...] stacked in rank order: [ranks m, ...] (`rows_fit`)."""
        return self.rows_kernels.one_shot_gather(
            x, *self.gathers.args(), self.half_elems, pdl=self.pdl
        )

    def reduce_scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's block [m, ...] of the sum over the group of x [ranks m, ...]."""
        return self.rows_kernels.one_shot_reduce_scatter(
            x, *self.scatters.args(), self.half_elems, pdl=self.pdl
        )


def one_shot_for(
    group: dist.ProcessGroup, device: torch.device, pdl: bool, rows: bool = False
) -> OneShotAllReduce | None:
    """A `OneShotAllReduce` for the group where the device supports it, else None (the
    caller stays with NCCL); `rows`: with the row gather and reduce-scatter. Collective
    over the group: every rank calls it alike."""
    if not available(device):
        return None
    one_shot = OneShotAllReduce(group, device, pdl, rows)
    logger.info("one-shot all-reduce (Triton, symmetric memory) for tensors up to %d elements",
                one_shot.half_elems)  # fmt: skip
    return one_shot
