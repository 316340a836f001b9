"""A one-shot all-reduce for small tensors over torch's symmetric memory (CUDA only).

A TP decode step all-reduces two activations per layer of a few KiB each; NCCL
spends ~15 us on each, mostly latency. `torch.ops.symm_mem.one_shot_all_reduce_out`
is one kernel: every rank copies its tensor into a buffer that every peer can read
(NVLink P2P), the ranks meet at a barrier on a signal pad, and each sums all the
buffers itself. It reads world_size times the tensor, so it wins for small tensors
only: larger ones (prefill chunks) and other dtypes stay with NCCL.

No NVLink multicast: the multimem operations are never called. CUDA graphs capture
it (the buffer's address is fixed). `--disable-custom-all-reduce` turns it off;
`available` says whether this machine's torch and GPUs support it at all.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# NOTE: the largest tensor sent through it: a batch of 64 rows of 4096 bf16 values is
# 512 KiB; beyond ~1 MiB reading every peer's copy costs more than NCCL's ring
MAX_BYTES = 1 << 20


def available(device: torch.device) -> bool:
    """Whether symmetric memory can be used on this device (CUDA, torch with symm_mem)."""
    if device.type != "cuda":
        return False
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError:
        return False
    return hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out")


class OneShotAllReduce:
    """The one-shot sum over `group` of tensors of `dtype` up to `max_bytes`.

    Every rank of the group builds it at the same point (the buffer's rendezvous is
    collective)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        device: torch.device,
        dtype: torch.dtype,
        max_bytes: int = MAX_BYTES,
    ):
        import torch.distributed._symmetric_memory as symm_mem

        self.dtype = dtype
        self.group_name = group.group_name
        self.buffer = symm_mem.empty(max_bytes // dtype.itemsize, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.buffer.numel() and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group, written into x (contiguous, `fits`)."""
        n = x.numel()
        staged = self.buffer[:n]
        staged.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, x.view(-1))
        return x


def one_shot_for(
    group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype | None
) -> OneShotAllReduce | None:
    """A `OneShotAllReduce` for the group when `dtype` is given and the device supports
    it, else None (the caller stays with NCCL). Collective over the group: every rank
    calls it with the same arguments and gets the same answer."""
    if dtype is None or not available(device):
        return None
    one_shot = OneShotAllReduce(group, device, dtype)
    logger.info("one-shot all-reduce (symmetric memory) for %s tensors up to %d bytes",
                dtype, MAX_BYTES)  # fmt: skip
    return one_shot
