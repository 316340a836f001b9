"""The plan builder: one DP rank's decision -> its `RankBatch`.

Requests new to the rank's workers are sent once in full (`NewRequest`); rows
send deltas: start position, input ids (PLACEHOLDER for tokens in flight), new
pages, whether to sample, how many draft slots to verify, and for a floating
row how many drafts in flight its start may still move by. Draft tokens never
appear here: the worker makes them.
"""

from __future__ import annotations

from collections.abc import Sequence

from gyrfalcon.ipc.contract import is_steady_verify_row, step_tokens
from gyrfalcon.ipc.messages import ForwardMode, NewRequest, RankBatch, ScheduledRow
from gyrfalcon.scheduler.policy import Decision
from gyrfalcon.scheduler.step_log import is_decode_row


def forward_mode(decision: Decision) -> ForwardMode:
    """IDLE without rows; DECODE (VERIFY when rows carry draft slots) when every row
    is a decode; PREFILL when none is; else MIXED."""
    if not decision.rows:
        return ForwardMode.IDLE
    decodes = sum(1 for s in decision.rows if is_decode_row(s.num_tokens, s.req.num_generated))
    if decodes == len(decision.rows):
        return ForwardMode.VERIFY if any(s.num_draft for s in decision.rows) else ForwardMode.DECODE
    return ForwardMode.PREFILL if decodes == 0 else ForwardMode.MIXED


def rank_batch(decision: Decision, finished_rids: list[str]) -> RankBatch:
    """The rank's batch, before the decision is applied to its requests (positions
    and input ids are read from their state as it was planned)."""
    new_requests, rows = [], []
    for s in decision.rows:
        req = s.req
        if not req.sent_to_worker:
            new_requests.append(NewRequest(req.rid, req.prompt_ids, req.sampling))
            req.sent_to_worker = True
        ids = req.tokens_slice(s.start, s.start + s.num_tokens)
        row = ScheduledRow(
            req.rid, s.start, ids, s.new_pages, s.samples, s.reset, s.num_draft, s.drafts_in_flight
        )
        rows.append(row)
    return RankBatch(forward_mode(decision), rows, new_requests, finished_rids)


def agreed_graph(batches: list[RankBatch], num_draft: int = 0) -> tuple[int, int]:
    """(rows, tokens per row) of the graph every DP rank replays when their collectives
    span the DP groups (`StepPlan.graph_rows`, `graph_width`): the most rows of any rank
    (an IDLE rank runs one dummy row) when every other batch is a plain DECODE (1 token
    a row), or when every other batch is a uniform VERIFY: each row one input token and
    all `num_draft` drafts (num_draft + 1 tokens a row, the VERIFY graphs' width).
    Else (0, 1): one rank's prefill, mixed or ragged verify step runs outside these
    graphs, and so must every rank (as piecewise graphs at `agreed_tokens`, or
    eagerly), since an eager rank gathers row counts on the host where a replaying
    one would not."""
    widths: set[int] = set()
    for b in batches:
        if b.forward_mode == ForwardMode.DECODE:
            widths.add(1)
        elif b.forward_mode == ForwardMode.VERIFY and num_draft > 0:
            steady = all(is_steady_verify_row(r, num_draft) for r in b.rows)
            widths.add(num_draft + 1 if steady else 0)
        elif b.forward_mode != ForwardMode.IDLE:
            return 0, 1
    if len(widths) > 1 or 0 in widths:
        return 0, 1
    return max(max(len(b.rows) for b in batches), 1), widths.pop() if widths else 1


def agreed_tokens(batches: list[RankBatch], sizes: Sequence[int]) -> int:
    """The token count every DP rank runs a step without an agreed graph at, as
    piecewise graphs (`StepPlan.graph_tokens`): the smallest of `sizes` (the counts
    the workers captured, ascending; `piecewise_sizes`) holding the most tokens of any
    rank's batch (`step_tokens`; an IDLE rank's dummy row has one). 0 when the most
    exceed every size, or without sizes: every rank then runs eagerly."""
    most = max(step_tokens(b.rows) or 1 for b in batches)
    return next((size for size in sizes if size >= most), 0)
