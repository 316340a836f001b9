"""How hard gradient clipping binds: over a window of training steps, the median of
the gradients' total norms (before clipping) and the share of steps whose norm
exceeded --max-grad-norm.

AdamW divides each gradient by its running scale, so the size of its updates is set
by --lr; clipping only reweights steps against each other (those above the limit
count less). When nearly every step is clipped, every gradient enters at the same
norm and a higher --max-grad-norm that still clips them all changes nothing but
AdamW's epsilon term: a sweep should know that before it spends a run on one.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GradStats:
    median: float  # the median total norm over the window
    clipped_share: float  # the share of the window's steps with a norm above the limit


def grad_norm_stats(norms: Sequence[float], max_norm: float) -> GradStats:
    """Median and clipped share of `norms` (one per step, before clipping; non-empty):
    a step counts as clipped when its norm is above `max_norm`."""
    if not norms:
        raise ValueError("no steps in the window")
    return GradStats(statistics.median(norms), sum(v > max_norm for v in norms) / len(norms))
