"""The Triton backend's warm-up (Triton interpreter on CPU): every kernel build an eager
step launches (a MIXED step's decode rows, eager VERIFY / DRAFT_EXTEND rows, DECODE
batches no graph holds) is one the warm-up launched first. A build missed costs a served
step ~0.7 s on a GPU (worker/compile_watch.py); the GPU twin of these is
test/gpu/test_spec_gpu.py::test_serving_builds_no_triton_kernel_after_the_warm_up."""

import pytest
import torch
from triton_attention_cases import (  # NOTE: sets TRITON_INTERPRET
    CPU,
    LAYER,
    PS,
    make_batch,
    make_case,
    make_replay_batch,
)

from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.triton_backend import TritonBackend
from gyrfalcon.layers.attention.triton_meta import MAX_VERIFY_TOKENS, decode_kv_splits


def _build_key(q, args, kw) -> tuple:
    """What of a `decode_attention` call (q, then its other arguments) makes its own Triton
    build: tensor dtypes (the index tensors' among them), the split count, the
    compile-time choices (EARLY_KV last), q's row stride as specialized (% 16).
    tokens_per_row is not specialized (attention_decode.py)."""
    from gyrfalcon.kernels.attention_launch import early_first_block

    table, lens, scratch, rope = args[2], args[3], args[5], kw.get("rope")
    rope_dtypes = rope and (rope.k.dtype, rope.positions.dtype, rope.loc.dtype, rope.cos_sin.dtype)
    pack = kw.get("pack", False)
    rows = q.shape[0] // kw.get("tokens_per_row", 1) if pack else q.shape[0]
    early = early_first_block(rows, args[0], scratch.num_kv_splits, kw.get("pdl", True), pack)
    return (q.dtype, table.dtype, lens.dtype, scratch.num_kv_splits, pack,
            rope is None, q.stride(0) % 16 == 0, rope_dtypes, early)  # fmt: skip


# SMs the split counts below are chosen for: a GPU-like count, so that the warm-up meets
# every split count up to MAX_KV_SPLITS (the CPU's nominal count, `num_sms`, stops at 4)
SMS = 8


def _early(programs: int, *_) -> bool:
    """EARLY_KV as a GPU rule would pick it (the CPU has no PDL, `early_kv_block`): up to
    a program count that splits some split count's row counts into both builds here."""
    return programs <= 4 * SMS


def _record_launches(monkeypatch) -> list:
    from gyrfalcon.kernels import attention_launch
    from gyrfalcon.layers.attention import triton_backend

    monkeypatch.setattr(triton_backend, "num_sms", lambda device: SMS)
    monkeypatch.setattr(attention_launch, "num_sms", lambda device: SMS)
    monkeypatch.setattr(attention_launch, "early_kv_block", _early)
    launches = []
    real = triton_backend.decode_attention

    def record(q, *args, **kw):
        launches.append((q.shape[0], _build_key(q, args, kw), kw))
        return real(q, *args, **kw)

    monkeypatch.setattr(triton_backend, "decode_attention", record)
    return launches


def test_warm_up_launches_the_decode_kernel_at_every_split_count_of_eager_rows(monkeypatch):
    """Eager rows run the decode kernel without RoPE at a split count that depends on
    their number of query rows (a MIXED step's decode rows, or every query token of
    eager verify rows: up to MAX_VERIFY_TOKENS a row); each count, and within one the
    EARLY_KV choice (`_early`), is its own kernel build, so the warm-up launches every
    pair that 3 rows of up to 16 tokens can pick (`SMS`), with q a view of a qkv row as
    `attend` gets it. Counting rows and not tokens, it built the kernel while serving
    (stop 39); keyed by split count alone, the small-grid build (stop 66)."""
    launches = _record_launches(monkeypatch)
    heads, kv_heads, d = 4, 2, 16
    tri = TritonBackend(heads, kv_heads, d, d**-0.5, decode_block_n=16)
    cache = KVCache(2, 8, PS, kv_heads, d, torch.float32, CPU)
    tri.warm_up_kernels(cache, torch.float32, 3, PS)
    splits = {n: decode_kv_splits(n, kv_heads, SMS, d) for n in range(1, 3 * MAX_VERIFY_TOKENS + 1)}
    want = {(s, _early(n * kv_heads * s)) for n, s in splits.items()}
    assert {(key[3], key[-1]) for _, key, _ in launches} == want
    assert {s for s, _ in want} == {1, 2, 4, 8, 16}
    assert any((s, not e) in want for s, e in want)  # a split count in both builds
    assert len(launches) == len(want)
    for rows, key, kw in launches:
        assert decode_kv_splits(rows, kv_heads, SMS, d) == key[3] and kw.get("rope") is None
        assert key[1] == key[2] == torch.int32
        # NOTE: Triton specializes an int on == 1 and % 16: a qkv row's width or, for
        # a single row, the contiguous H * D (torch's stride of a size-1 dim)
        assert key[6]


@pytest.mark.parametrize("mode", [ForwardMode.VERIFY, ForwardMode.DRAFT_EXTEND])
def test_eager_rows_of_any_length_launch_the_builds_the_warm_up_made(monkeypatch, mode):
    """Eager batches whose rows all hold T tokens launch the decode kernel as the
    warm-up does, whatever T is: unpacked, RoPE apart, T only a runtime argument, int32
    page table and lengths, a split count the warm-up launched. A packed launch is a
    build per T (eager DRAFT_EXTEND batches of 2, 8 and 16 tokens a row built it five
    times while serving, stop 38), and the batch's own int64 tables four more (stop 39).
    The same rows pack as a graph replays them."""
    launches = _record_launches(monkeypatch)
    heads, kv_heads, d = 6, 2, 16  # a group of 3: every T below fits a packed block
    tri = TritonBackend(heads, kv_heads, d, d**-0.5, decode_block_n=16)
    tri.warm_up_kernels(KVCache(2, 8, PS, kv_heads, d, torch.float32, CPU), torch.float32, 2, PS)
    warmed = {key for _, key, _ in launches}
    del launches[:]
    for t in (2, 4, 8, 16):
        assert tri.packs(t)
        cache, rows = make_case([(3, t), (9, t)], kv_heads, d, t)
        tb = make_batch(rows, cache, tri, mode)
        assert tb.attn_meta.verify_tokens == t and not tb.attn_meta.packed
        assert not tri.fuses_rope(tb)
        q = torch.randn(2 * t, heads, d)
        tri.forward(q, torch.randn(2 * t, kv_heads, d), torch.randn(2 * t, kv_heads, d), LAYER, tb)
    assert [kw["tokens_per_row"] for _, _, kw in launches] == [2, 4, 8, 16]
    for _, key, _ in launches:
        assert key in warmed, (key, warmed)
    cache, rows = make_case([(3, 4), (9, 4)], kv_heads, d, 0)
    replayed = make_replay_batch(rows, cache, tri, mode)
    assert replayed.attn_meta.packed and tri.fuses_rope(replayed)


def test_eager_decode_batches_no_graph_holds_launch_the_builds_the_warm_up_made(monkeypatch):
    """DECODE batches larger than the largest graph run eagerly with RoPE inside the
    decode kernel; the warm-up launches that build at every split count of those row
    counts (rows 3..12 here), with RoPE's tensors of a step's dtypes (int64 positions and
    slots, a float32 cos | sin table). Missing, a tiny spec engine built it while
    serving on a GPU (stop 39)."""
    from gyrfalcon.kernels.rotary import build_cos_sin_cache
    from gyrfalcon.layers.rotary import rope_inv_freq

    launches = _record_launches(monkeypatch)
    heads, kv_heads, d = 4, 2, 16
    tri = TritonBackend(heads, kv_heads, d, d**-0.5, decode_block_n=16)
    tri.warm_up_kernels(KVCache(2, 8, PS, kv_heads, d, torch.float32, CPU), torch.float32, 0, PS,
                        range(3, 13))  # fmt: skip
    warmed = {key for _, key, _ in launches}
    assert {key[3] for key in warmed} == {
        decode_kv_splits(n, kv_heads, SMS, d) for n in range(3, 13)
    }
    assert all(kw.get("rope") is not None for _, _, kw in launches)
    del launches[:]
    cos_sin = build_cos_sin_cache(rope_inv_freq(d, 10000.0, None), 128)
    for n in (3, 5, 12):
        cache, rows = make_case([(4 * i + 2, 1) for i in range(n)], kv_heads, d, n)
        tb = make_batch(rows, cache, tri, ForwardMode.DECODE)
        assert tri.fuses_rope(tb)
        q, k, v = (torch.randn(n, h, d) for h in (heads, kv_heads, kv_heads))
        tri.attend_rope(q, k, v, tb.positions, cos_sin, LAYER, tb)
    assert len(launches) == 3
    for _, key, _ in launches:
        assert key in warmed, (key, warmed)
