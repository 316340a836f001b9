"""ForwardBatch: which rows attend as decodes comes from the mode, once per step, and
every metadata build checks the batch's shapes (spec-decode bug classes 4 and 5)."""

import pytest
import torch

from gyrfalcon.forward.batch import ForwardBatch, decode_rows
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import RowInput, build_batch_tensors, leading_single_token_rows
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.registry import RoleBackends, create_backends
from gyrfalcon.layers.attention.torch_ref import TorchRefBackend

CPU = torch.device("cpu")
PS = 4
M = ForwardMode


def batch_of(mode, spec, backend=None):
    """spec: (prefix, q_len) per row, on pages 1.. in order."""
    rows, page = [], 1
    for prefix, n in spec:
        count = -(-(prefix + n) // PS)
        rows.append(RowInput(prefix, [5] * n, list(range(page, page + count))))
        page += count
    cache = KVCache(1, page, PS, 2, 16, torch.float32, CPU)
    bt = build_batch_tensors(rows, PS, CPU)
    backend = backend or TorchRefBackend(4, 2, 16, 0.25)
    return ForwardBatch.from_tensors(mode, bt, PS, cache, backend)


def test_leading_single_token_rows():
    assert leading_single_token_rows([1, 1, 5, 1]) == 2
    assert leading_single_token_rows([3, 1]) == 0
    assert leading_single_token_rows([1, 1]) == 2
    assert leading_single_token_rows([]) == 0


def test_decode_rows_follow_the_mode():
    assert decode_rows(M.DECODE, 3, 3) == 3
    assert decode_rows(M.DRAFT_DECODE, 2, 2) == 2
    assert decode_rows(M.MIXED, 2, 5) == 2
    assert decode_rows(M.PREFILL, 1, 3) == 1  # a one-token chunk first attends as a decode
    assert decode_rows(M.VERIFY, 0, 4) == 0
    with pytest.raises(AssertionError):
        decode_rows(M.DECODE, 2, 3)  # a DECODE batch whose rows are not all single-token


def test_from_tensors_marks_decode_rows_by_mode():
    assert batch_of(M.DECODE, [(3, 1), (0, 1)]).num_decode_rows == 2
    assert batch_of(M.MIXED, [(3, 1), (0, 1), (0, 5), (6, 1)]).num_decode_rows == 2
    assert batch_of(M.VERIFY, [(3, 2), (5, 2)]).num_decode_rows == 0
    with pytest.raises(AssertionError):
        batch_of(M.DECODE, [(3, 1), (0, 4)])


def test_check_rejects_inconsistent_batches():
    batch_of(M.MIXED, [(3, 1), (0, 5)]).check()
    # a multi-step slot list [bs * steps] against [bs] lengths (bug class 4)
    b = batch_of(M.DECODE, [(3, 1), (8, 1)])
    b.out_cache_loc = torch.cat([b.out_cache_loc, b.out_cache_loc])
    with pytest.raises(AssertionError):
        b.check()
    b = batch_of(M.DECODE, [(3, 1), (8, 1)])
    b.seq_lens = b.seq_lens[:1]  # one step's lengths for the wrong batch
    with pytest.raises(AssertionError):
        b.check()
    b = batch_of(M.VERIFY, [(3, 4), (8, 4)])
    b.seq_lens_cpu = [0, 12]  # a zero (or negative) length after a shift (bug class 5)
    with pytest.raises(AssertionError):
        b.check()
    b = batch_of(M.VERIFY, [(3, 4)])
    b.seq_lens_cpu = [9 * PS]  # beyond the row's page capacity
    with pytest.raises(AssertionError):
        b.check()
    b = batch_of(M.MIXED, [(3, 1), (0, 5)])
    b.num_decode_rows = 2  # a claimed decode row with 5 tokens
    with pytest.raises(AssertionError):
        b.check()
    b = batch_of(M.MIXED, [(3, 1), (0, 5)])
    b.out_cache_loc = b.out_cache_loc[:-1]
    with pytest.raises(AssertionError):
        TorchRefBackend(4, 2, 16, 0.25).build_metadata(b)  # the backends run the checks


def test_one_backend_instance_per_role():
    roles = create_backends("torch_ref", "torch_ref", 4, 2, 16, 0.25)
    assert isinstance(roles, RoleBackends)
    assert len({id(roles.extend), id(roles.decode), id(roles.verify)}) == 3
    assert roles.for_mode(M.DECODE) is roles.decode
    assert roles.for_mode(M.DRAFT_DECODE) is roles.decode
    assert roles.for_mode(M.VERIFY) is roles.verify
    for mode in (M.PREFILL, M.MIXED, M.DRAFT_EXTEND, M.IDLE):
        assert roles.for_mode(mode) is roles.extend


def test_torch_ref_attends_only_the_leading_rows_as_decodes():
    """A one-token row after an extend row is an extend row of one token: the same
    output as the decode of that row alone."""
    spec = [(6, 1), (2, 1), (0, 5), (9, 1)]  # pages [1, 2], [3], [4, 5], [6, 7, 8]
    b = batch_of(M.MIXED, spec)
    ref = b.attn_backend
    gen = torch.Generator().manual_seed(0)
    b.kv_cache.k.copy_(torch.randn(b.kv_cache.k.shape, generator=gen))
    b.kv_cache.v.copy_(torch.randn(b.kv_cache.v.shape, generator=gen))
    b.attn_meta = ref.build_metadata(b)
    assert b.attn_meta.decode_tokens.tolist() == [0, 1]
    assert [e.token_start for e in b.attn_meta.extends] == [2, 7]
    q = torch.randn(b.num_tokens, 4, 16, generator=gen)
    out = ref.attend(q, 0, b)
    bt = build_batch_tensors([RowInput(9, [5], [6, 7, 8])], PS, CPU)
    alone = ForwardBatch.from_tensors(M.DECODE, bt, PS, b.kv_cache, ref)
    alone.attn_meta = ref.build_metadata(alone)
    assert alone.attn_meta.decode_tokens.tolist() == [0]
    torch.testing.assert_close(out[7], ref.attend(q[7:], 0, alone)[0])
