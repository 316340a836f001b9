"""Start-up warm-up: one step of each kind, run before the engine reports ready.

Kernels compile on first use (Triton, flashinfer's JIT): without a warm-up the
first requests wait for them, seconds to minutes on a fresh machine. The batches
below go through the same path as the scheduler's (`StepWorker.submit_batch`), on
the reserved dummy page (which padding rows already write), so nothing else is
touched. Every rank runs the same batches, so collectives line up.
`warm_up_roles` then launches, on the dummy page, the attention kernels' builds that
eager steps may need and these batches do not meet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gyrfalcon.ipc.contract import DUMMY_PAGE, PLACEHOLDER, pages_needed
from gyrfalcon.ipc.messages import (
    ForwardMode,
    NewRequest,
    RankBatch,
    SamplingParams,
    ScheduledRow,
)

if TYPE_CHECKING:
    import torch

    from gyrfalcon.forward.kv_cache import KVCache
    from gyrfalcon.layers.attention.registry import RoleBackends
    from gyrfalcon.worker.cuda_graph import GraphRunner

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


PROFILE_SAMPLING = SamplingParams(
    temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, repetition_penalty=1.1,
    frequency_penalty=0.1, logprobs=5, max_tokens=2,
)  # fmt: skip
"""Every sampling feature on at once: the costliest rows the sampler can be given."""


def profile_rows(budget: int, max_seqs: int, chunk: int, longest: int) -> list[int]:
    """Prompt lengths of the largest prefill step the scheduler can plan: as many rows
    as it runs at once (max_seqs, at most one per token), `budget` tokens in all when
    that many fit, each at most `chunk` and `longest` tokens, the lengths within one of
    each other (the first ones longer)."""
    assert min(budget, max_seqs, chunk, longest) >= 1, (budget, max_seqs, chunk, longest)
    n = min(max_seqs, budget)
    total = min(budget, n * min(chunk, longest))
    return [total // n + (i < total % n) for i in range(n)]


def profile_batches(
    page_size: int,
    budget: int,
    max_seqs: int,
    chunk: int,
    context_len: int,
    num_draft: int = 0,
) -> list[RankBatch]:
    """The steps that need the most activation memory, for `worker/memory_profile.py`:
    a prefill of `profile_rows` (the most tokens a step holds: under DP attention with
    expert parallelism every MoE layer gathers that many from every group), every row
    sampled; then every row decodes, verifying `num_draft` drafts (the most logit rows
    a step holds: max_seqs x (k + 1)); then the drop. Every row samples with
    `PROFILE_SAMPLING` and every page is the dummy page; positions stay below
    context_len (none where it leaves no room for a prompt token and the decode)."""
    k = num_draft
    longest = context_len - 1 - (k + 1)  # NOTE: the decode row's last position < context_len
    if longest < 1:
        return []
    lengths = profile_rows(budget, max_seqs, chunk, longest)
    rids = [f"profile-{i}" for i in range(len(lengths))]
    new = [NewRequest(r, [TOKEN] * n, PROFILE_SAMPLING) for r, n in zip(rids, lengths)]
    prefill = [
        ScheduledRow(r, 0, [TOKEN] * n, [DUMMY_PAGE] * pages_needed(0, n, page_size), True)
        for r, n in zip(rids, lengths)
    ]
    decode = [
        ScheduledRow(
            r,
            n,
            [PLACEHOLDER],
            [DUMMY_PAGE] * pages_needed(-(-n // page_size), n + 1 + k, page_size),
            True,
            False,
            k,
        )  # fmt: skip
        for r, n in zip(rids, lengths)
    ]
    mode = ForwardMode.VERIFY if k else ForwardMode.DECODE
    return [
        RankBatch(ForwardMode.PREFILL, prefill, new),
        RankBatch(mode, decode),
        RankBatch(ForwardMode.IDLE, [], [], rids),
    ]


def eager_rows(graphs: GraphRunner | None, mode: ForwardMode, max_rows: int) -> range:
    """The row counts of `mode` batches (up to max_rows rows) that no graph serves."""
    return range((graphs.largest(mode) if graphs is not None else 0) + 1, max_rows + 1)


def warm_up_roles(
    backends: RoleBackends,
    graphs: GraphRunner | None,
    decode_mode: ForwardMode,
    kv_cache: KVCache,
    dtype: torch.dtype,
    max_rows: int,
    page_size: int,
) -> None:
    """Each role's kernel builds for eager steps of up to max_rows rows
    (`AttentionBackend.warm_up_kernels`): extend (MIXED, DRAFT_EXTEND) and verify rows,
    and the `decode_mode` batches no graph serves."""
    for backend in (backends.extend, backends.verify):
        backend.warm_up_kernels(kv_cache, dtype, max_rows, page_size)
    eager = eager_rows(graphs, decode_mode, max_rows)
    backends.decode.warm_up_kernels(kv_cache, dtype, 0, page_size, eager)
