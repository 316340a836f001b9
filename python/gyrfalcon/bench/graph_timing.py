"""Kernel timing as decode runs kernels: inside a replayed CUDA graph (CUDA only)."""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable

import torch


def time_graph(fns: list[Callable[[], object]], replays: int) -> float:
    """Median microseconds per call of a CUDA graph running every fn once, in order
    (the first two run once outside the graph first: lazy inits, autotuning)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    gc.disable()  # a collection mid-capture can invalidate it
    try:
        with torch.cuda.graph(graph):
            for fn in fns:
                fn()
    finally:
        gc.enable()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    del graph
    return 1e3 * statistics.median(times) / len(fns)
