"""The plan builder: one DP rank's decision -> its `RankBatch`.

Requests new to the rank's workers are sent once in full (`NewRequest`); rows
send deltas: start position, input ids (PLACEHOLDER for tokens in flight), new
pages, whether to sample, how many draft slots to verify, and for a floating
row how many drafts in flight its start may still move by. Draft tokens never
appear here: the worker makes them.
"""

from __future__ import annotations

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


def agreed_graph_rows(batches: list[RankBatch]) -> int:
    """The batch size every DP rank replays its graph at when their collectives span
    the DP groups (`StepPlan.graph_rows`): the most rows of any rank (an IDLE rank runs
    one dummy row) when every batch is a plain DECODE or IDLE, else 0: one rank's
    prefill or verify step, which runs eagerly, makes every rank run eagerly, since an
    eager rank gathers row counts on the host where a replaying one would not."""
    if any(b.forward_mode not in (ForwardMode.DECODE, ForwardMode.IDLE) for b in batches):
        return 0
    return max(max(len(b.rows) for b in batches), 1)
