import pytest
import torch

from gyrfalcon.forward.metadata import RowInput, build_batch_tensors, slot_of


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


def test_slot_of_matches_table_walk():
    pages = [7, 2, 9]
    assert [slot_of(pages, p, 4) for p in range(12)] == (
        [28, 29, 30, 31, 8, 9, 10, 11, 36, 37, 38, 39]
    )


def test_row_without_enough_pages_is_rejected():
    with pytest.raises(AssertionError, match="KV slots"):
        build_batch_tensors([RowInput(3, [1, 2], [1])], page_size=4, device=torch.device("cpu"))
