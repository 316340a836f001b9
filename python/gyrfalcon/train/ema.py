"""An exponential moving average of the drafter's weights (`--ema-decay`).

After every optimizer step the average moves toward the weights by a rate r:
    avg <- avg + r (w - avg),   r = max(1 - decay, 1 / n)   (n: updates so far)
so the first updates are the plain running mean (the average never starts from the
random initialization) and later ones the usual EMA. Evaluations and the exported
checkpoint use the average (`applied`, `store`); training continues on the weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


class WeightAverage:
    def __init__(self, params: Sequence[torch.nn.Parameter], decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"an EMA decay is in (0, 1), not {decay}")
        self.params = list(params)
        self.decay = decay
        self.updates = 0
        self.average = [p.detach().clone() for p in self.params]

    def rate(self) -> float:
        """The weight of the current weights in the next update (module docstring)."""
        return max(1.0 - self.decay, 1.0 / (self.updates + 1))

    @torch.no_grad()
    def update(self) -> None:
        rate = self.rate()
        self.updates += 1
        torch._foreach_lerp_(self.average, [p.detach() for p in self.params], rate)

    @contextmanager
    def applied(self) -> Iterator[None]:
        """The parameters hold the average inside the block, their own values after."""
        with torch.no_grad():
            kept = [p.detach().clone() for p in self.params]
            self.store()
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_([p.data for p in self.params], kept)

    @torch.no_grad()
    def store(self) -> None:
        """Copy the average into the parameters (for good: the trained result)."""
        torch._foreach_copy_([p.data for p in self.params], self.average)
