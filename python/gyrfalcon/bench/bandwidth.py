"""Achievable device memory read bandwidth, the denominator of the decode roofline.

The measurement reduces (``torch.sum``) one buffer much larger than any cache,
so its time is the time to stream the buffer from memory; a ``copy`` variant
reads and writes it (2 x nbytes moved). On CUDA each iteration is timed with
CUDA events; elsewhere with the wall clock. The best iteration is reported,
as the roofline wants what the memory system can do, not its average under noise.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

METHODS = ("sum", "copy")


def best_rate(bytes_moved: int, seconds: list[float]) -> float:
    """Bytes per second of the fastest of `seconds`."""
    best = min(seconds)
    if best <= 0:
        raise ValueError(f"non-positive timing {best}")
    return bytes_moved / best


def _time_cuda(fn: Callable[[], object], iters: int) -> list[float]:
    """Seconds of each call of `fn`, from CUDA events around it."""
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def _time_wall(fn: Callable[[], object], iters: int) -> list[float]:
    """Seconds of each call of `fn` by the wall clock."""
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def measure_read_bandwidth(
    device: torch.device | str,
    nbytes: int = 1 << 30,
    iters: int = 20,
    method: str = "sum",
    warmup: int = 3,
) -> float:
    """Best-of-`iters` memory bandwidth of `device` in bytes/s.

    `nbytes` is the buffer size (use well above the last-level cache: the
    default 1 GiB suits a GPU; a few hundred MiB suits a CPU). With
    ``method="sum"`` the bytes moved are `nbytes` (read only); with
    ``method="copy"`` they are 2 x `nbytes` (read + write).
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r} (choose from {METHODS})")
    if nbytes < 4 or iters < 1:
        raise ValueError(f"need nbytes >= 4 and iters >= 1, got {nbytes}, {iters}")
    device = torch.device(device)
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    if method == "sum":
        out = torch.empty((), dtype=torch.float32, device=device)

        def fn() -> object:
            return torch.sum(src, dim=0, out=out)

        moved = n * 4
    else:
        dst = torch.empty_like(src)

        def fn() -> object:
            return dst.copy_(src)

        moved = 2 * n * 4
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.synchronize()
            times = _time_cuda(fn, iters)
    else:
        times = _time_wall(fn, iters)
    return best_rate(moved, times)
