"""A step's host index lists, gathered row by row: placeholder and draft fills, the
tokens whose logits sample, floating rows, and the drafter's round over the drafting
rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

from gyrfalcon.forward.metadata import RowInput
from gyrfalcon.ipc.contract import PLACEHOLDER
from gyrfalcon.ipc.messages import ScheduledRow
from gyrfalcon.worker.request_table import WorkerRequest


def placeholder_indices(input_ids: list[int]) -> list[int]:
    """The indices of a row's PLACEHOLDER inputs (tokens the scheduler has not seen yet;
    a decode row's one input, in the steady state)."""
    if PLACEHOLDER not in input_ids:  # NOTE: a C scan: prompt chunks hold none
        return []
    return [j for j, tok in enumerate(input_ids) if tok == PLACEHOLDER]


def batch_input_ids(row: ScheduledRow) -> list[int]:
    """The row's ids in the step's batch: its inputs, then a 0 for each draft it verifies
    (filled on the device). NOTE: the row's own list where it has no drafts."""
    return list(row.input_ids) + [0] * row.num_draft if row.num_draft else row.input_ids


def latest_start(row: ScheduledRow) -> int:
    """The row's start with every draft in flight accepted: its own start but for a
    floating row, whose device start may be up to drafts_in_flight earlier."""
    return row.start + row.drafts_in_flight


@dataclass
class StepLayout:
    """Host index lists of one step, gathered row by row (`add`).

    Token indices are into the step's T tokens (rows' inputs, then their drafts). The
    drafter's ids come from ids = [T step tokens | S * K1 emitted | next prompt tokens]
    (`StepWorker._draft`): the token after extend position i of a row is its input i + 1, else
    (its last input) the first token it emitted, then its further emitted tokens, or
    for a chunk that does not sample the prompt token after it.

    A floating row (`ScheduledRow.drafts_in_flight` > 0) is laid out at its latest
    start (`latest_start`); the worker moves it to the device's start with
    `forward.metadata.shift_rows`, in the step's batch and in the drafter's.
    """

    num_tokens: int  # T
    num_emitted: int  # S * K1
    width: int  # K1
    ph_pos: list[int] = field(default_factory=list)  # PLACEHOLDER inputs: token index
    ph_slot: list[int] = field(default_factory=list)  # and the slot holding the id
    dr_pos: list[int] = field(default_factory=list)  # draft inputs: token index
    dr_src: list[int] = field(default_factory=list)  # and slot * k + j in draft_tokens
    logit_tokens: list[int] = field(default_factory=list)  # tokens whose logits sample
    logit_starts: list[int] = field(default_factory=list)  # per sampling row
    sample_tokens: list[int] = field(default_factory=list)  # per sampling row: last input
    next_tokens: list[int] = field(default_factory=list)  # after drafted chunks
    # floating rows: batch rows, request slots, their tokens and each token's index
    # into fl_rows; the same rows in the drafter's extend batch
    fl_rows: list[int] = field(default_factory=list)
    fl_slots: list[int] = field(default_factory=list)
    fl_tokens: list[int] = field(default_factory=list)
    fl_token_rows: list[int] = field(default_factory=list)
    fl_ext_rows: list[int] = field(default_factory=list)
    fl_ext_tokens: list[int] = field(default_factory=list)
    # the drafter's round (draft_round.DraftRound)
    ext_rows: list[RowInput] = field(default_factory=list)
    ext_ids_src: list[int] = field(default_factory=list)
    ext_aux_idx: list[int] = field(default_factory=list)
    anchor_idx: list[int] = field(default_factory=list)
    accept_row: list[int] = field(default_factory=list)
    ext_row: list[int] = field(default_factory=list)
    last_pos: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    anchor_pos_cpu: list[int] = field(default_factory=list)
    last_pos_cpu: list[int] = field(default_factory=list)
    _tokens: int = 0
    _rows: int = 0
    _samples: int = 0
    _full_verify_rows: int = 0  # drafting rows that verify k drafts after one input

    def add(
        self,
        row: ScheduledRow,
        req: WorkerRequest,
        k: int,
        drafting: bool,
        max_model_len: int,
        page_size: int,
    ) -> None:
        t0, n, d = self._tokens, len(row.input_ids), row.num_draft
        if row.drafts_in_flight:
            assert drafting and row.sample, "a floating row verifies drafts"
            self.fl_rows.append(self._rows)
            self.fl_slots.append(req.slot)
            self.fl_token_rows.extend([len(self.fl_rows) - 1] * (n + d))
            self.fl_tokens.extend(range(t0, t0 + n + d))
        for j in placeholder_indices(row.input_ids):
            self.ph_pos.append(t0 + j)
            self.ph_slot.append(req.slot)
        self.dr_pos.extend(range(t0 + n, t0 + n + d))
        self.dr_src.extend(range(req.slot * k, req.slot * k + d))
        if row.sample:
            self.logit_starts.append(len(self.logit_tokens))
            self.logit_tokens.extend(range(t0 + n - 1, t0 + n + d))
            self.sample_tokens.append(t0 + n - 1)
        if drafting:
            self._add_drafting(row, req, t0, n, d, max_model_len, page_size)
            self._full_verify_rows += n == 1 and d == k
        self._tokens += n + d
        self._rows += 1
        self._samples += row.sample

    def add_plain(self, rows: list[ScheduledRow], reqs: list[WorkerRequest]) -> None:
        """`add` for rows that verify no drafts and do not draft (nor float), at once:
        their placeholder fills and their sampling rows' logit tokens (each its last
        input), a list comprehension over the rows rather than a call per row."""
        assert not any(row.num_draft or row.drafts_in_flight for row in rows), "plain rows"
        q_lens = [len(row.input_ids) for row in rows]
        firsts = list(accumulate(q_lens, initial=self._tokens))  # row i: [firsts[i], firsts[i + 1])
        if q_lens.count(1) == len(q_lens):  # NOTE: decode rows: the one input, or none
            fills = [i for i, row in enumerate(rows) if row.input_ids[0] == PLACEHOLDER]
            self.ph_pos.extend(firsts[i] for i in fills)
            self.ph_slot.extend(reqs[i].slot for i in fills)
        else:
            for t0, row, req in zip(firsts, rows, reqs):
                for j in placeholder_indices(row.input_ids):
                    self.ph_pos.append(t0 + j)
                    self.ph_slot.append(req.slot)
        last = [end - 1 for end, row in zip(firsts[1:], rows) if row.sample]
        self.logit_starts.extend(range(len(self.logit_tokens), len(self.logit_tokens) + len(last)))
        self.logit_tokens.extend(last)
        self.sample_tokens.extend(last)
        self._tokens = firsts[-1]
        self._rows += len(rows)
        self._samples += len(last)

    def _add_drafting(
        self,
        row: ScheduledRow,
        req: WorkerRequest,
        t0: int,
        n: int,
        d: int,
        max_model_len: int,
        page_size: int,
    ) -> None:
        e0 = sum(len(r.input_ids) for r in self.ext_rows)
        start = latest_start(row)
        if row.drafts_in_flight:
            self.fl_ext_rows.append(len(self.ext_rows))
            self.fl_ext_tokens.extend(range(e0, e0 + n + d))
        self.ext_rows.append(RowInput(start, [0] * (n + d), req.pages))
        self.ext_aux_idx.extend(range(t0, t0 + n + d))
        self.ext_ids_src.extend(t0 + i + 1 for i in range(n - 1))
        if row.sample:
            first = self.num_tokens + self._samples * self.width
            self.ext_ids_src.extend(first + m for m in range(d + 1))
            last_pos = min(len(req.pages) * page_size, max_model_len) - 1
            self.anchor_idx.append(e0 + n - 1)
            self.accept_row.append(self._samples)
            self.ext_row.append(len(self.ext_rows) - 1)
            self.last_pos.append(last_pos)
            self.slots.append(req.slot)
            self.anchor_pos_cpu.append(start + n - 1 + d)
            self.last_pos_cpu.append(last_pos)
        else:
            assert d == 0, "a row with drafts samples"
            self.ext_ids_src.append(self.num_tokens + self.num_emitted + len(self.next_tokens))
            self.next_tokens.append(req.token_at(row.start + n))

    @property
    def uniform(self) -> bool:
        """Whether every drafting row verifies k drafts after one input (the layout a
        captured draft round serves: drafter.py)."""
        return self._full_verify_rows == len(self.ext_rows)

    def lists(self) -> list[list[int]]:
        """The main batch's extra lists, in `StepWorker._launch`'s unpacking order (slots after)."""
        return [
            self.ph_pos,
            self.ph_slot,
            self.dr_pos,
            self.dr_src,
            self.logit_tokens,
            self.next_tokens,
            self.sample_tokens,
            self.fl_rows,
            self.fl_slots,
            self.fl_tokens,
            self.fl_token_rows,
        ]

    def draft_lists(self) -> list[list[int]]:
        """The extend batch's extra lists, in `DraftRound`'s field order."""
        return [
            self.ext_ids_src,
            self.ext_aux_idx,
            self.anchor_idx,
            self.accept_row,
            self.ext_row,
            self.last_pos,
            self.slots,
        ]

    def float_ext_lists(self) -> list[list[int]]:
        """The floating rows in the extend batch (rows, tokens), uploaded after
        `draft_lists`; their tokens' rows are `fl_token_rows` (same rows, same order)."""
        return [self.fl_ext_rows, self.fl_ext_tokens]
