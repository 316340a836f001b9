"""Two drafters on the same prompts: the difference of their acceptance in rounds
(tokens per verify step over all prompts) with a paired bootstrap interval.

Both were measured on the same answers (`benchmarks/eval_drafter.py` on one machine:
the target's greedy answers are the same for every drafter), so prompt i of one
pairs with prompt i of the other. Resampling prompts with replacement and taking
the difference of the two ratios-of-sums on each resample gives the spread of the
difference that the choice of prompts alone would make; an interval that holds 0
says the prompts cannot tell the drafters apart.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

Rounds = Sequence[Sequence[int]]  # per prompt: (verify steps, tokens they emit)


def in_rounds(rounds: Rounds, picks: Sequence[int] | None = None) -> float:
    """Tokens per verify step over the prompts `picks` (default: all, once each)."""
    idx = range(len(rounds)) if picks is None else picks
    steps = sum(rounds[i][0] for i in idx)
    return sum(rounds[i][1] for i in idx) / max(1, steps)


@dataclass(frozen=True)
class Difference:
    a: float  # in rounds, the first drafter
    b: float  # the second
    low: float  # the bootstrap interval of b - a
    high: float

    @property
    def delta(self) -> float:
        return self.b - self.a


def paired_difference(
    a: Rounds, b: Rounds, resamples: int = 10000, level: float = 0.95, seed: int = 0
) -> Difference:
    """b - a in rounds, and its `level` percentile interval over `resamples` paired
    bootstrap draws of the prompts (seeded). ValueError unless both hold the same
    prompts' answers (the same count and the same tokens per prompt)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"not the same prompts: {len(a)} and {len(b)} sequences")
    if [r[1] for r in a] != [r[1] for r in b]:
        raise ValueError("the prompts' answers differ in length: not one machine's answers")
    rng = random.Random(seed)
    n = len(a)
    deltas = []
    for _ in range(resamples):
        picks = [rng.randrange(n) for _ in range(n)]
        deltas.append(in_rounds(b, picks) - in_rounds(a, picks))
    deltas.sort()
    tail = (1.0 - level) / 2
    low = deltas[int(tail * (resamples - 1))]
    high = deltas[int((1.0 - tail) * (resamples - 1))]
    return Difference(in_rounds(a), in_rounds(b), low, high)
