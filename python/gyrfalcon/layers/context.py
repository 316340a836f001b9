"""LayerContext: what every layer of one model is built with.

One per model and rank, made by the executor (from the server arguments and the
rank's parallel context) and passed to every layer constructor; layers keep it and
read nothing process-wide. A target model and its drafter may share one.
"""

from __future__ import annotations

from dataclasses import dataclass

from gyrfalcon.forward.parallel import SINGLE_RANK, ParallelContext
from gyrfalcon.kernels.dispatch import DEFAULT_KERNELS, KernelPolicy


@dataclass(frozen=True)
class LayerContext:
    kernels: KernelPolicy = DEFAULT_KERNELS  # fused kernels on CUDA, PDL launches
    parallel: ParallelContext = SINGLE_RANK  # TP rank, size and all-reduce
