from array import array

import pytest
import torch

from gyrfalcon.forward.metadata import (
    RowInput,
    advanced_rows,
    aligned_token_rows,
    build_batch_tensors,
    leading_single_token_rows,
    padded_page_table,
    row_slots,
    slot_of,
)


def test_slots_positions_and_padding():
    rows = [
        RowInput(0, [5, 6, 7], [3]),
        RowInput(5, [9], [4, 8]),
        RowInput(2, [1, 2, 3, 4], [2, 6]),
    ]
    bt = build_batch_tensors(rows, page_size=4, device=torch.device("cpu"))
    assert bt.input_ids.tolist() == [5, 6, 7, 9, 1, 2, 3, 4]
    assert bt.positions.tolist() == [0, 1, 2, 5, 2, 3, 4, 5]
    # page 3 -> slots 12..; position 5 of row 1 is page 8 offset 1 -> 33
    assert bt.out_cache_loc.tolist() == [12, 13, 14, 33, 10, 11, 24, 25]
    assert bt.seq_lens.tolist() == [3, 6, 6]
    assert bt.q_lens.tolist() == [3, 1, 4]
    assert bt.q_starts.tolist() == [0, 3, 4]
    assert bt.last_token_idx.tolist() == [2, 3, 7]
    assert bt.page_table.tolist() == [[3, 0], [4, 8], [2, 6]]  # padded with dummy page 0


def test_one_upload_carries_extra_lists_and_token_rows_view_it():
    rows = [RowInput(0, [5, 6], [3]), RowInput(5, [9], [4, 8])]
    bt = build_batch_tensors(rows, 4, torch.device("cpu"), extra=[[7, 8, 9], [], [1]])
    assert [t.tolist() for t in bt.extra] == [[7, 8, 9], [], [1]]
    assert bt.page_table.tolist() == [[3, 0], [4, 8]]  # after the extras, intact
    assert bt.token_rows.tolist() == [[5, 6, 9], [0, 1, 5], [12, 13, 33]]
    bt.input_ids[2] = 4  # e.g. the worker's placeholder fill: the rows view the same ids
    assert bt.token_rows[0].tolist() == [5, 6, 4]
    # the rows' lengths, one [3, bs] view (what a whole piecewise graph copies in at once)
    assert bt.row_lens.tolist() == [[2, 6], [2, 1], [0, 2]]
    bt.seq_lens[1] = 5  # e.g. a floating row's shift, in place
    assert bt.row_lens[0].tolist() == [2, 5]


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


@pytest.mark.parametrize("lens", [[1], [3], [1, 2], [3, 1, 1], [2, 5, 1, 1, 3]])
def test_every_index_tensor_starts_16_byte_aligned(lens):
    """Triton builds a kernel per pointer-alignment class: fields that started wherever
    the step's token and row counts put them would build kernels again while serving
    (worker/compile_watch.py). Odd counts everywhere, values intact."""
    rows = [RowInput(i, [7] * n, [i + 1, i + 2]) for i, n in enumerate(lens)]
    bt = build_batch_tensors(rows, 4, torch.device("cpu"), extra=[[1, 2, 3], [4], []])
    fields = [bt.input_ids, bt.positions, bt.out_cache_loc, bt.seq_lens, bt.q_lens]
    fields += [bt.q_starts, bt.last_token_idx, bt.page_table, *bt.extra, *bt.token_rows]
    fields += list(bt.row_lens)
    assert all(_aligned(t) for t in fields)
    assert bt.token_rows.tolist() == [bt.input_ids.tolist(), bt.positions.tolist(),
                                      bt.out_cache_loc.tolist()]  # fmt: skip
    assert [t.tolist() for t in bt.extra] == [[1, 2, 3], [4], []]
    assert bt.page_table.tolist() == [[i + 1, i + 2] for i in range(len(lens))]
    copy = aligned_token_rows(bt.token_rows)
    assert all(_aligned(r) for r in copy) and torch.equal(copy, bt.token_rows)
    m = len(lens)  # a draft step's batch of m rows, built on the device
    step = advanced_rows(bt.seq_lens, bt.seq_lens - 1, 1, bt.seq_lens + 4, bt.page_table, 4,
                         [8] * m)  # fmt: skip
    assert all(_aligned(t) for t in (step.input_ids, step.positions, step.out_cache_loc))


def test_slot_of_matches_table_walk():
    pages = [7, 2, 9]
    assert [slot_of(pages, p, 4) for p in range(12)] == (
        [28, 29, 30, 31, 8, 9, 10, 11, 36, 37, 38, 39]
    )


def test_row_without_enough_pages_is_rejected():
    with pytest.raises(AssertionError, match="KV slots"):
        build_batch_tensors([RowInput(3, [1, 2], [1])], page_size=4, device=torch.device("cpu"))


def test_each_draft_step_gets_its_own_positions_slots_and_lengths():
    """advanced_rows (a draft step's batch, built on the device) == the metadata builder
    on the same rows at step j: position anchor + j, its own slot, length + 1; capped at
    the row's last position (spec-decode bug class 3)."""
    ps = 4
    pages = [[5, 2, 7], [3, 9, 1]]
    table = torch.tensor(pages)
    anchor, last = torch.tensor([5, 2]), torch.tensor([8, 11])
    ids = torch.tensor([11, 12])
    for j in (1, 2, 3, 4):
        bt = advanced_rows(ids, anchor, j, last, table, ps, [12, 12])
        pos = [min(a + j, e) for a, e in zip(anchor.tolist(), last.tolist())]
        ref = build_batch_tensors(
            [RowInput(p, [i], pg) for p, i, pg in zip(pos, ids.tolist(), pages)],
            ps,
            torch.device("cpu"),
        )
        assert bt.positions.tolist() == pos == ref.positions.tolist()
        assert bt.out_cache_loc.tolist() == ref.out_cache_loc.tolist()
        assert bt.seq_lens.tolist() == ref.seq_lens.tolist()
        assert bt.input_ids.tolist() == [11, 12]
    assert pos[0] == 8  # row 0 capped at its last position from step 3


def test_a_draft_step_sees_only_its_own_slots():
    """A draft step's batch holds m slots for m rows; a backend handed the whole round's
    slot list ([m * k]) is refused by the shape checks every metadata build runs
    (spec-decode bug class 4)."""
    import dataclasses

    from gyrfalcon.forward.batch import ForwardBatch
    from gyrfalcon.forward.metadata import advanced_rows
    from gyrfalcon.ipc.messages import ForwardMode
    from gyrfalcon.layers.attention.torch_ref import TorchRefBackend

    table = torch.tensor([[1, 2], [3, 4]])
    bt = advanced_rows(torch.tensor([5, 6]), torch.tensor([1, 2]), 1, torch.tensor([7, 7]),
                       table, 4, [4, 5])  # fmt: skip
    backend = TorchRefBackend(2, 2, 8, 1.0)
    batch = ForwardBatch.from_tensors(ForwardMode.DRAFT_DECODE, bt, 4, None, backend)
    batch.check()
    assert batch.out_cache_loc.shape == (2,) and batch.num_decode_rows == 2
    whole = torch.cat([bt.out_cache_loc, bt.out_cache_loc + 1, bt.out_cache_loc + 2])
    bad = dataclasses.replace(batch, out_cache_loc=whole)
    with pytest.raises(AssertionError):
        bad.check()


def test_a_floating_row_moves_to_its_device_start():
    """shift_rows (floating rows: built at their latest start, moved on the device) ==
    the metadata builder at the true starts: positions, KV slots through the page table
    (across a page edge), lengths; other rows and the host bounds untouched."""
    from gyrfalcon.forward.metadata import shift_rows

    ps, cpu = 4, torch.device("cpu")
    pages = [[5, 2, 7, 8], [3], [6, 1, 4]]
    latest = [RowInput(9, [1, 2, 3, 4], pages[0]), RowInput(1, [5], pages[1]),
              RowInput(6, [6, 7, 8], pages[2])]  # fmt: skip
    shifts = {0: -3, 2: -2}  # rows 0 and 2 float; their rows in flight accepted less
    true = [
        RowInput(r.start + shifts.get(i, 0), r.input_ids, r.pages) for i, r in enumerate(latest)
    ]
    bt = build_batch_tensors(latest, ps, torch.device("cpu"))
    rows, tokens, token_rows = [0, 2], [0, 1, 2, 3, 5, 6, 7], [0, 0, 0, 0, 1, 1, 1]
    t = lambda x: torch.tensor(x)  # noqa: E731
    shift_rows(bt, t(rows), t([shifts[0], shifts[2]]), t(tokens), t(token_rows), ps)
    ref = build_batch_tensors(true, ps, cpu)
    assert bt.positions.tolist() == ref.positions.tolist()
    assert bt.out_cache_loc.tolist() == ref.out_cache_loc.tolist()
    assert bt.seq_lens.tolist() == ref.seq_lens.tolist() == [10, 2, 7]
    assert bt.input_ids.tolist() == ref.input_ids.tolist()
    assert bt.seq_lens_cpu == [13, 2, 9]  # host values stay upper bounds
    assert bt.token_rows[1].tolist() == ref.positions.tolist()  # the view moved too


@pytest.mark.parametrize(
    "start,end", [(0, 1), (3, 4), (4, 5), (0, 12), (2, 11), (3, 9), (5, 5), (7, 8), (1, 4)]
)
def test_row_slots_walks_the_table_a_position_at_a_time(start, end):
    """Runs within a page, across page boundaries, one token, none."""
    pages = [7, 2, 9]
    assert row_slots(pages, start, end, 4) == [slot_of(pages, p, 4) for p in range(start, end)]
    assert row_slots(array("q", pages), start, end, 4) == row_slots(pages, start, end, 4)


def test_padded_page_table_pads_lists_and_int64_arrays_alike():
    rows = [[3, 1], array("q", [4, 8, 6]), [], array("q"), [2**40]]
    want = [[3, 1, 9], [4, 8, 6], [9, 9, 9], [9, 9, 9], [2**40, 9, 9]]
    table = padded_page_table(rows, 3, 9)
    assert table.typecode == "q" and table.tolist() == [p for row in want for p in row]


def _reference_tensors(rows: list[RowInput], ps: int, extra: list[list[int]]) -> dict:
    """What build_batch_tensors uploads, computed a token at a time."""
    ids, pos, slots, q_starts = [], [], [], []
    for r in rows:
        q_starts.append(len(ids))
        ids += r.input_ids
        pos += range(r.start, r.start + len(r.input_ids))
        slots += [slot_of(r.pages, p, ps) for p in range(r.start, r.start + len(r.input_ids))]
    width = max(len(r.pages) for r in rows)
    return {
        "input_ids": ids,
        "positions": pos,
        "out_cache_loc": slots,
        "seq_lens": [r.start + len(r.input_ids) for r in rows],
        "q_lens": [len(r.input_ids) for r in rows],
        "q_starts": q_starts,
        "last_token_idx": [s + len(r.input_ids) - 1 for s, r in zip(q_starts, rows)],
        "page_table": [list(r.pages) + [0] * (width - len(r.pages)) for r in rows],
        "extra": extra,
    }


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("decode", [False, True])
def test_build_batch_tensors_equals_a_token_at_a_time_build(seed, decode):
    """Decode batches (one token a row: the fast path) and mixed ones (multi-token rows,
    drafts' zeros, placeholders, rows across page boundaries), list or array pages."""
    import random

    rng, ps = random.Random(seed), 4
    rows = []
    for i in range(rng.randint(1, 9)):
        n = 1 if decode or rng.random() < 0.5 else rng.randint(2, 11)
        start = rng.randint(0, 20)
        pages = rng.sample(range(1, 100), -(-(start + n) // ps) + rng.randint(0, 2))
        ids = [rng.choice([-1, 0, rng.randint(1, 500)]) for _ in range(n)]
        rows.append(RowInput(start, ids, array("q", pages) if i % 2 else pages))
    extra = [[rng.randint(0, 9) for _ in range(rng.randint(0, 5))] for _ in range(3)]
    bt = build_batch_tensors(rows, ps, torch.device("cpu"), extra=extra)
    want = _reference_tensors(rows, ps, extra)
    assert [t.tolist() for t in bt.extra] == want.pop("extra")
    assert {k: getattr(bt, k).tolist() for k in want} == want
    assert bt.seq_lens_cpu == want["seq_lens"] and bt.q_lens_cpu == want["q_lens"]
    assert bt.q_starts_cpu == want["q_starts"]
    assert bt.token_rows.tolist() == [want["input_ids"], want["positions"], want["out_cache_loc"]]
    assert bt.leading_single_rows == leading_single_token_rows(want["q_lens"])
