"""The CSR page layout handed to flashinfer (pure index math; runs without flashinfer)."""

import pytest
import torch

from gyrfalcon.layers.attention.flashinfer_backend import paged_csr


def test_csr_of_ragged_batch():
    csr = paged_csr([1, 4, 5, 9], max_pages=3, page_size=4)
    assert csr.indptr == [0, 1, 2, 4, 7]
    assert csr.flat_index == [0, 3, 6, 7, 9, 10, 11]
    assert csr.last_page_len == [1, 4, 1, 1]
    table = torch.tensor([[7, 0, 0], [2, 0, 0], [5, 8, 0], [1, 3, 6]])
    assert table.reshape(-1)[torch.tensor(csr.flat_index)].tolist() == [7, 2, 5, 8, 1, 3, 6]


def test_csr_rejects_empty_rows_and_short_tables():
    with pytest.raises(AssertionError):
        paged_csr([0], max_pages=2, page_size=4)
    with pytest.raises(AssertionError):
        paged_csr([9], max_pages=2, page_size=4)
