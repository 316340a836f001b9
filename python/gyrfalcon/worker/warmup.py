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
WARMUP_CHUNK = 24  # sets the prompt rows' lengths (`prompt_chunks`)


def prompt_chunks(chunk: int) -> tuple[int, int, int]:
    """(first and second prefill chunk of the greedy request, the sampled request's
    prompt): chunk + chunk // 2, chunk and chunk // 2 tokens (at least 1), so that
    Triton's extend kernel meets the query block sizes of long, middling and short
    rows (BLOCK_M 64, 32, 16 at chunk 24: `extend_block_sizes`), each a build of its
    own."""
    return chunk + chunk // 2, chunk, max(1, chunk // 2)


def warmup_last_position(chunk: int, num_draft: int = 0) -> int:
    """The last position `warmup_batches(_, chunk, num_draft)` writes."""
    first, second, _ = prompt_chunks(chunk)
    return first + second + (2 + num_draft if num_draft else 1)


def warmup_chunk(context_len: int, num_draft: int = 0) -> int:
    """The largest chunk <= WARMUP_CHUNK whose warm-up fits `context_len` positions
    (0: none does)."""
    for chunk in range(WARMUP_CHUNK, 0, -1):
        if warmup_last_position(chunk, num_draft) < context_len:
            return chunk
    return 0


def warmup_batches(
    page_size: int, chunk: int = WARMUP_CHUNK, num_draft: int = 0
) -> list[RankBatch]:
    """Prefill, a chunk on a cached prefix, a mixed step (a decode row beside a
    prefill, one greedy and one sampled row), a decode step, then the drop (an IDLE
    batch: its dummy row runs too). The prompt rows differ in length (`prompt_chunks`).

    With a drafter (num_draft = k > 0) the mixed step's decode row and both decode
    rows verify k drafts (a VERIFY step, greedy beside sampled: the general path), and
    a greedy VERIFY row alone follows (the fused step where graphs serve it): every
    kernel a spec server's mixed steps launch compiles now, not at its first
    arrivals. A verify row continues as if it accepted nothing.

    Every page of both requests is the dummy page. The longest request reaches
    position `warmup_last_position(chunk, k)`."""
    a, b = WARMUP_RIDS
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=2)
    k = num_draft
    first, second, short = prompt_chunks(chunk)
    p = first + second  # the greedy request's prompt

    held = {a: 0, b: 0}  # pages each request holds

    def row(rid: str, start: int, n: int, sample: bool, placeholder: bool = False, d: int = 0):
        pages = pages_needed(held[rid], start + n + d, page_size)
        held[rid] += pages
        ids = [PLACEHOLDER] if placeholder else [TOKEN] * n
        return ScheduledRow(rid, start, ids, [DUMMY_PAGE] * pages, sample, False, d)

    new = [NewRequest(a, [TOKEN] * p, greedy), NewRequest(b, [TOKEN] * short, sampled)]
    decode = ForwardMode.VERIFY if k else ForwardMode.DECODE
    steps = [
        (ForwardMode.PREFILL, [new[0]], [row(a, 0, first, False)]),
        (ForwardMode.PREFILL, [], [row(a, first, second, True)]),
        (ForwardMode.MIXED, [new[1]], [row(a, p, 1, True, True, k), row(b, 0, short, True)]),
        (decode, [], [row(a, p + 1, 1, True, True, k), row(b, short, 1, True, True, k)]),
    ]
    if k:
        steps.append((decode, [], [row(a, p + 2, 1, True, True, k)]))
    steps.append((ForwardMode.IDLE, [], []))
    return [RankBatch(m, r, n, [] if r else list(WARMUP_RIDS)) for m, n, r in steps]
