"""Start-up warm-up: one step of each kind, run before the engine reports ready.

Kernels compile on first use (Triton, flashinfer's JIT): without a warm-up the
first requests wait for them, seconds to minutes on a fresh machine. The batches
below go through the same path as the scheduler's (`StepWorker.submit_batch`), on
the reserved dummy page (which padding rows already write), so nothing else is
touched. Every rank runs the same batches, so collectives line up.
"""

from __future__ import annotations

from gyrfalcon.ipc.contract import DUMMY_PAGE, PLACEHOLDER, pages_needed
from gyrfalcon.ipc.messages import (
    ForwardMode,
    NewRequest,
    RankBatch,
    SamplingParams,
    ScheduledRow,
)

WARMUP_RIDS = ("warmup-greedy", "warmup-sampled")
TOKEN = 1  # any id the vocabulary has
WARMUP_CHUNK = 24  # prompt tokens per prefill row


def warmup_batches(page_size: int, chunk: int = WARMUP_CHUNK) -> list[RankBatch]:
    """Prefill, a chunk on a cached prefix, a mixed step (a decode row beside a
    prefill, one greedy and one sampled row), a decode step, then the drop (an IDLE
    batch: its dummy row runs too).

    Every page of both requests is the dummy page. The longest request reaches
    position 2 * chunk + 1."""
    a, b = WARMUP_RIDS
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=2)

    def row(rid: str, start: int, n: int, sample: bool, placeholder: bool = False):
        pages = pages_needed(pages_needed(0, start, page_size), start + n, page_size)
        ids = [PLACEHOLDER] if placeholder else [TOKEN] * n
        return ScheduledRow(rid, start, ids, [DUMMY_PAGE] * pages, sample, False)

    new = [NewRequest(a, [TOKEN] * 2 * chunk, greedy), NewRequest(b, [TOKEN] * chunk, sampled)]
    c = chunk
    steps = [
        (ForwardMode.PREFILL, [new[0]], [row(a, 0, c, False)]),
        (ForwardMode.PREFILL, [], [row(a, c, c, True)]),
        (ForwardMode.MIXED, [new[1]], [row(a, 2 * c, 1, True, True), row(b, 0, c, True)]),
        (ForwardMode.DECODE, [], [row(a, 2 * c + 1, 1, True, True), row(b, c, 1, True, True)]),
        (ForwardMode.IDLE, [], []),
    ]
    return [RankBatch(m, r, n, [] if r else list(WARMUP_RIDS)) for m, n, r in steps]
