"""Metadata builder: scheduled rows + page tables -> ForwardBatch tensors.

Pure index math, so it is unit-tested on its own:
  positions of row r:   start_r .. start_r + n_r - 1
  KV slot of position p: page_table_r[p // page_size] * page_size + p % page_size
  seq_len of row r:     start_r + n_r   (KV valid after this step)
  leading single rows:  the longest prefix of rows with n_r == 1 (the scheduler
                        puts decodes first; `ForwardBatch.from_tensors` decides
                        by the mode which of them attend as decodes)
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import NamedTuple

import torch

from gyrfalcon.forward.host_copy import upload_int64


class RowInput(NamedTuple):
    """One row of a step's batch. NOTE: a NamedTuple, not a frozen dataclass: the worker
    builds one per row every step, and a tuple is built twice as fast."""

    start: int  # first position computed this step (= tokens already in KV)
    input_ids: list[int]
    # the request's full page table after this step's allocation (a list, or an int64
    # array, which the step's upload copies whole: `WorkerRequest.pages`)
    pages: Sequence[int]


@dataclass
class BatchTensors:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_cache_loc: torch.Tensor  # [T]
    seq_lens: torch.Tensor  # [bs]
    q_lens: torch.Tensor  # [bs]
    q_starts: torch.Tensor  # [bs]
    page_table: torch.Tensor  # [bs, max_pages]
    last_token_idx: torch.Tensor  # [bs] index in [T] of each row's last new token
    seq_lens_cpu: list[int]
    q_lens_cpu: list[int]
    q_starts_cpu: list[int]
    extra: list[torch.Tensor]  # the caller's `extra` int lists, uploaded with the rest
    token_rows: torch.Tensor  # [3, T] view: input_ids, positions, out_cache_loc
    leading_single_rows: int  # rows [0, n) have one new token each (host value)
    # [3, bs] view: seq_lens, q_lens, q_starts (where they are one block of the upload)
    row_lens: torch.Tensor | None = None


# int64 elements per 16 bytes: Triton specializes a kernel on whether each pointer it
# takes is 16-byte aligned, so index tensors that started wherever the step's sizes put
# them would build kernels again while serving (worker/compile_watch.py)
ALIGN = 2


def aligned_len(n: int) -> int:
    """n rounded up to a multiple of ALIGN: the room a field of n int64s takes in a
    step's packed upload, so that the next one starts 16-byte aligned."""
    return -(-n // ALIGN) * ALIGN


def aligned_token_rows(token_rows: torch.Tensor) -> torch.Tensor:
    """A copy of [3, T] token rows (ids, positions, slots) whose rows start 16-byte
    aligned, as `build_batch_tensors` lays them out."""
    t = token_rows.shape[1]
    out = token_rows.new_empty(3, aligned_len(t))[:, :t]
    out.copy_(token_rows)
    return out


def leading_single_token_rows(q_lens: list[int]) -> int:
    """How many rows at the start of the batch have exactly one new token."""
    if q_lens.count(1) == len(q_lens):  # NOTE: decode batches, without a Python loop
        return len(q_lens)
    n = 0
    while n < len(q_lens) and q_lens[n] == 1:
        n += 1
    return n


def slot_of(pages: Sequence[int], pos: int, page_size: int) -> int:
    return pages[pos // page_size] * page_size + pos % page_size


def row_slots(pages: Sequence[int], start: int, end: int, page_size: int) -> list[int]:
    """The KV slots of positions [start, end) (`slot_of` at each), a page's run at a
    time: the positions within one page have consecutive slots."""
    slots: list[int] = []
    pos = start
    while pos < end:
        page, offset = divmod(pos, page_size)
        run = min(end - pos, page_size - offset)
        first = pages[page] * page_size + offset
        slots.extend(range(first, first + run))
        pos += run
    return slots


def padded_page_table(pages: Sequence[Sequence[int]], width: int, dummy_page: int) -> array:
    """The rows' page tables, each padded with the dummy page to `width` pages, as one
    flat int64 array (row-major [rows, width])."""
    table = array("q")
    pad = array("q", [dummy_page])
    for row in pages:
        # NOTE: a memcpy where the row is an int64 array already (`WorkerRequest.pages`);
        # array.extend converts a list an element at a time, slower than array() does
        table.extend(row if isinstance(row, array) and row.typecode == "q" else array("q", row))
        if len(row) < width:
            table.extend(pad * (width - len(row)))
    return table


def build_batch_tensors(
    rows: list[RowInput],
    page_size: int,
    device: torch.device,
    dummy_page: int = 0,
    extra: list[list[int]] | None = None,
) -> BatchTensors:
    """The step's index tensors, in one host->device copy; `extra` int lists (e.g. the
    worker's per-row state slots) ride along in the same copy as `bt.extra`."""
    starts = [row.start for row in rows]
    q_lens = [len(row.input_ids) for row in rows]
    seq_lens = [s + n for s, n in zip(starts, q_lens)]
    num_pages = [len(row.pages) for row in rows]
    assert min(q_lens, default=1) >= 1, "a scheduled row computes at least one token"
    short = [i for i, (n, end) in enumerate(zip(num_pages, seq_lens)) if n * page_size < end]
    assert not short, (
        f"row needs {seq_lens[short[0]]} KV slots, has {num_pages[short[0]]} pages of {page_size}"
    )
    leading_single = leading_single_token_rows(q_lens)
    if leading_single == len(rows):  # NOTE: a decode batch: one token a row, no token loop
        ids = [row.input_ids[0] for row in rows]
        positions = starts
        # `slot_of` at each row's start, inlined (a call per row costs as much again)
        slots = [
            row.pages[s // page_size] * page_size + s % page_size for row, s in zip(rows, starts)
        ]
        q_starts = list(range(len(rows)))
        last = q_starts
    else:
        ids = list(chain.from_iterable(row.input_ids for row in rows))
        positions = list(chain.from_iterable(map(range, starts, seq_lens)))
        slots = list(
            chain.from_iterable(
                row_slots(row.pages, s, end, page_size)
                for row, s, end in zip(rows, starts, seq_lens)
            )
        )
        q_starts = list(accumulate(q_lens[:-1], initial=0)) if rows else []
        last = [s + n - 1 for s, n in zip(q_starts, q_lens)]
    max_pages = max(num_pages, default=1)

    # NOTE: one host->device copy for the whole step; the fields are views of it, each
    # starting 16-byte aligned (`aligned_len`)
    extra = extra or []
    parts = [ids, positions, slots, seq_lens, q_lens, q_starts, last, *extra]
    flat: list[int] = []
    for part in parts:
        flat += part
        if len(part) % ALIGN:
            flat += [0] * (aligned_len(len(part)) - len(part))
    packed_host = array("q", flat)
    packed_host += padded_page_table([r.pages for r in rows], max_pages, dummy_page)
    packed = upload_int64(packed_host, device)
    # NOTE: one split for every field, its padding and the table (a slice per field
    # costs a torch call each): the fields are the even pieces, the table the last
    sizes = [n for part in parts for n in (len(part), aligned_len(len(part)) - len(part))]
    pieces = packed.split([*sizes, len(packed) - sum(sizes)])
    t_ids, t_pos, t_slots, t_seq, t_q, t_starts, t_last, *t_extra = pieces[:-1:2]
    t_table = pieces[-1]
    width = aligned_len(len(ids))
    bs_width = aligned_len(len(rows))  # NOTE: seq_lens, q_lens, q_starts follow the tokens
    row_lens = packed[3 * width : 3 * width + 3 * bs_width].view(3, bs_width)[:, : len(rows)]

    bt = BatchTensors(
        input_ids=t_ids,
        positions=t_pos,
        out_cache_loc=t_slots,
        seq_lens=t_seq,
        q_lens=t_q,
        q_starts=t_starts,
        page_table=t_table.view(len(rows), max_pages),
        last_token_idx=t_last,
        seq_lens_cpu=seq_lens,
        q_lens_cpu=q_lens,
        q_starts_cpu=q_starts,
        extra=t_extra,
        token_rows=packed[: 3 * width].view(3, width)[:, : len(ids)],
        leading_single_rows=leading_single,
        row_lens=row_lens,
    )
    assert bt.input_ids.shape == bt.positions.shape == bt.out_cache_loc.shape
    assert bt.seq_lens.shape[0] == bt.q_lens.shape[0] == bt.page_table.shape[0] == len(rows)
    return bt


def advanced_rows(
    input_ids: torch.Tensor,
    anchor: torch.Tensor,
    step: int,
    last_pos: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    seq_lens_bound: list[int],
) -> BatchTensors:
    """A draft step's batch, one token per row, built on the device: row r computes
    input_ids[r] at position p_r = min(anchor[r] + step, last_pos[r]) (step 0: the rows
    at their anchors, which the drafter's steps graph starts from; anchor: the
    position of the row's last verified token, known on the device only; last_pos: the
    last position its pages and the context hold, where further steps' garbage goes),
    KV slot `slot_of(page_table[r], p_r)`, sequence length p_r + 1.

    seq_lens_bound: host upper bounds of the lengths (anchor at its largest), what
    host-side checks and grid sizes read; only backends that take each row's length
    from the device tensor may attend with it (`AttentionBackend.device_lengths`).
    """
    m = input_ids.shape[0]
    assert anchor.shape == last_pos.shape == (m,) and page_table.shape[0] == m
    assert len(seq_lens_bound) == m and step >= 0
    pos = torch.minimum(anchor + step, last_pos)  # [m]
    page = page_table.gather(1, (pos // page_size)[:, None]).squeeze(1)  # [m]
    # [3, m], rows 16-byte aligned (`aligned_token_rows`)
    token_rows = input_ids.new_empty(3, aligned_len(m))[:, :m]
    torch.stack([input_ids, pos, page * page_size + pos % page_size], out=token_rows)
    rows = torch.arange(m, device=input_ids.device)
    return BatchTensors(
        input_ids=token_rows[0],
        positions=token_rows[1],
        out_cache_loc=token_rows[2],
        seq_lens=pos + 1,
        q_lens=torch.ones_like(rows),
        q_starts=rows,
        page_table=page_table,
        last_token_idx=rows,
        seq_lens_cpu=list(seq_lens_bound),
        q_lens_cpu=[1] * m,
        q_starts_cpu=list(range(m)),
        extra=[],
        token_rows=token_rows,
        leading_single_rows=m,
    )


def shift_rows(
    bt: BatchTensors,
    rows: torch.Tensor,
    shift: torch.Tensor,
    tokens: torch.Tensor,
    token_rows: torch.Tensor,
    page_size: int,
) -> None:
    """Move rows of bt by a number of positions known on the device only, in place
    (floating rows: the host built them at their latest start; shift <= 0 brings them
    to where the request's previous row ended). rows: [R] batch rows; shift: [R];
    tokens: [F] indices of those rows' tokens in [T]; token_rows: [F] each token's
    index into `rows`. Positions and lengths move by the shift, KV slots follow the
    positions through the page table; host values (seq_lens_cpu) stay upper bounds."""
    assert rows.shape == shift.shape and tokens.shape == token_rows.shape
    pos = bt.positions[tokens] + shift[token_rows]  # [F]
    page = bt.page_table[rows[token_rows], pos // page_size]
    bt.positions[tokens] = pos
    bt.out_cache_loc[tokens] = page * page_size + pos % page_size
    bt.seq_lens.index_add_(0, rows, shift)
