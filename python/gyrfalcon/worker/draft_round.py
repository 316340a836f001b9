"""The drafter's round of one target step as device tensors: its DRAFT_EXTEND batch
and per proposing row the indices the round reads (`DraftRound`), built from the
step's layout (`build_round`), and the ids its extend reads from (`round_ids`).
worker/drafter.py runs it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from gyrfalcon.forward.metadata import (
    BatchTensors,
    aligned_token_rows,
    build_batch_tensors,
    shift_rows,
)
from gyrfalcon.worker.step_layout import StepLayout


@dataclass
class DraftRound:
    """The drafting rows of one step, as index lists the step's upload carries."""

    ext: BatchTensors  # DRAFT_EXTEND batch: every token of the drafting rows
    ext_ids_src: torch.Tensor  # [Te] index of each extend token's id in the step's ids
    ext_aux_idx: torch.Tensor  # [Te] index of each extend token in the target batch
    # per proposing row (the drafting rows that sample), m of them:
    anchor_idx: torch.Tensor  # [m] extend index of the row's last input token
    accept_row: torch.Tensor  # [m] the row's index among the step's sampling rows
    ext_row: torch.Tensor  # [m] the row's index among the extend rows
    last_pos: torch.Tensor  # [m] last position its pages and the context hold
    slots: torch.Tensor  # [m] its request's slot in draft_tokens
    anchor_pos_cpu: list[int]  # anchor positions with every draft accepted (host bound)
    last_pos_cpu: list[int]
    uniform: bool = False  # every extend row is a verify row of k drafts (graphs serve it)


def build_round(
    layout: StepLayout,
    bt: BatchTensors,
    floating: tuple[torch.Tensor, torch.Tensor] | None,
    shared: list[torch.Tensor] | None,
    page_size: int,
    device: torch.device,
) -> DraftRound:
    """The round over a target step's drafting rows: layout and bt are the step's;
    floating: the floating rows' shifts and their tokens' rows (as in the step's
    batch); shared: the round's index lists when every row drafts, its extend batch
    then being the step's batch (moved already) with ids of its own (filled by the
    round, `Drafter.draft`); else the extend batch is uploaded from the layout."""
    if shared is not None:
        rows = aligned_token_rows(bt.token_rows)  # the drafter's ids go in [0]
        ext = dataclasses.replace(
            bt, input_ids=rows[0], positions=rows[1], out_cache_loc=rows[2],
            token_rows=rows, extra=shared,
        )  # fmt: skip
        fields = shared
    else:
        ext = build_batch_tensors(
            layout.ext_rows,
            page_size,
            device,
            extra=layout.draft_lists() + layout.float_ext_lists(),
        )
        *fields, fl_rows_t, fl_tokens_t = ext.extra
        if floating is not None:
            shift, token_rows = floating
            shift_rows(ext, fl_rows_t, shift, fl_tokens_t, token_rows, page_size)
    return DraftRound(ext, *fields, layout.anchor_pos_cpu, layout.last_pos_cpu, layout.uniform)


def round_ids(
    layout: StepLayout,
    bt: BatchTensors,
    emitted: torch.Tensor | None,
    accept_len: torch.Tensor | None,
    next_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the ids the round's `ext_ids_src` indexes: the step's inputs, its emitted ids
    (rejected ones clamped to 0), the next prompt tokens of drafted chunks; the drafts
    each sampling row accepted, zeros without sampling rows or drafts)."""
    s = layout.num_emitted // layout.width
    if emitted is None:  # NOTE: no sampling rows: the chunks' ids only
        emitted = bt.input_ids.new_zeros(0)
    if accept_len is None:
        accept_len = bt.input_ids.new_zeros(s)
    return torch.cat([bt.input_ids, emitted.reshape(-1).clamp_min(0), next_ids]), accept_len
