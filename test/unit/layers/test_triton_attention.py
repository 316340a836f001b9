"""Triton attention backend vs torch_ref on ragged paged batches (Triton interpreter on CPU)."""

import os

_PRIOR_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # NOTE: must precede every import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

if torch.cuda.is_available():
    # NOTE: kernels are interpreted or compiled once per session, when their module is
    # imported; on a GPU machine they must compile (test/gpu covers them there).
    if _PRIOR_INTERPRET is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _PRIOR_INTERPRET
    pytest.skip("CPU interpreter tests; test/gpu covers CUDA", allow_module_level=True)
pytest.importorskip("triton")

from gyrfalcon.forward.batch import ForwardBatch  # noqa: E402
from gyrfalcon.forward.kv_cache import KVCache  # noqa: E402
from gyrfalcon.forward.metadata import RowInput, build_batch_tensors  # noqa: E402
from gyrfalcon.ipc.messages import ForwardMode  # noqa: E402
from gyrfalcon.kernels import attention_decode  # noqa: E402
from gyrfalcon.layers.attention.registry import create_backend  # noqa: E402
from gyrfalcon.layers.attention.torch_ref import TorchRefBackend  # noqa: E402
from gyrfalcon.layers.attention.triton_backend import (  # noqa: E402
    MAX_KV_SPLITS,
    TritonBackend,
    decode_kv_splits,
)

if type(attention_decode._decode_split_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "the kernels were imported in compiled mode before TRITON_INTERPRET was set",
        allow_module_level=True,
    )

CPU = torch.device("cpu")
PS = 4  # page size
LAYER = 1  # a non-zero layer, so per-layer cache offsets are exercised
TOL = dict(atol=1e-4, rtol=1e-4)


def make_case(spec, num_kv_heads, head_dim, seed, pad_rows=0, kv_dtype=torch.float32):
    """spec: (prefix, q_len) per row -> (cache, rows); pages are scrambled, page 0 unused.

    Prefix KV is written as an earlier step would have; pad_rows decode rows of
    length 1 on the dummy page are appended.
    """
    gen = torch.Generator().manual_seed(seed)
    need = [-(-(p + n) // PS) for p, n in spec]
    perm = (torch.randperm(sum(need) + 3, generator=gen) + 1).tolist()
    cache = KVCache(2, sum(need) + 4, PS, num_kv_heads, head_dim, kv_dtype, CPU)
    # garbage everywhere (the dummy page included)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen).to(kv_dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen).to(kv_dtype))
    rows = []
    for (prefix, n), count in zip(spec, need):
        pages, perm = perm[:count], perm[count:]
        rows.append(RowInput(prefix, [0] * n, pages))
    rows += [RowInput(0, [0], [0])] * pad_rows
    return cache, rows


def make_batch(rows, cache, backend, mode):
    bt = build_batch_tensors(rows, PS, CPU)
    batch = ForwardBatch.from_tensors(mode, bt, PS, cache, backend)
    batch.attn_meta = backend.build_metadata(batch)
    return batch


def run_both(
    spec, heads, kv_heads, head_dim, mode, seed=0, pad_rows=0, kv_dtype=torch.float32, **kw
):
    """(triton output, torch_ref output, triton batch) on the same inputs."""
    cache, rows = make_case(spec, kv_heads, head_dim, seed, pad_rows, kv_dtype)
    scale = head_dim**-0.5
    tri = TritonBackend(heads, kv_heads, head_dim, scale, **kw)
    ref = TorchRefBackend(heads, kv_heads, head_dim, scale)
    tb = make_batch(rows, cache, tri, mode)
    rb = make_batch(rows, cache, ref, mode)
    gen = torch.Generator().manual_seed(seed + 1)
    # real tokens come first in [T]; padded rows' tokens get inputs of their own, so
    # real rows see the same q, k, v whatever pad_rows is
    n_real = sum(n for _, n in spec)
    q = torch.randn(n_real, heads, head_dim, generator=gen)
    k = torch.randn(n_real, kv_heads, head_dim, generator=gen)
    v = torch.randn(n_real, kv_heads, head_dim, generator=gen)
    if pad_rows:
        q = torch.cat([q, 100 * torch.randn(pad_rows, heads, head_dim)])
        k = torch.cat([k, 100 * torch.randn(pad_rows, kv_heads, head_dim)])
        v = torch.cat([v, 100 * torch.randn(pad_rows, kv_heads, head_dim)])
    if tb.attn_meta.scratch is not None:  # stale partials must never leak into outputs
        tb.attn_meta.scratch.mid_o.fill_(float("nan"))
        tb.attn_meta.scratch.mid_lse.fill_(float("nan"))
    # both write the same k, v to the same slots, so the order does not matter
    out = tri.forward(q, k, v, LAYER, tb)
    expect = ref.forward(q, k, v, LAYER, rb)
    return out, expect, tb


# decode lengths: 1, page edges (PS-1, PS, PS+1), block edges, and longer rows
DECODE_LENS = [1, PS - 1, PS, PS + 1, 16, 17, 45]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,splits",
    # the last: a GQA group of 16 whose partials take 4 merge tiles
    [(2, 2, 64, 1), (6, 2, 64, 3), (8, 2, 128, 4), (8, 1, 64, 8), (4, 4, 128, 2), (16, 1, 128, 16)],
)
def test_decode_matches_ref(heads, kv_heads, head_dim, splits):
    spec = [(n - 1, 1) for n in DECODE_LENS]
    out, expect, tb = run_both(
        spec, heads, kv_heads, head_dim, ForwardMode.DECODE, num_kv_splits=splits, decode_block_n=16
    )
    assert tb.attn_meta.is_decode and tb.attn_meta.scratch.num_kv_splits == splits
    assert out.shape == (len(spec), heads * head_dim)
    torch.testing.assert_close(out, expect, **TOL)
    # the program that merged each (row, KV head) reset its count for the next launch
    assert not tb.attn_meta.scratch.counts.any()


def test_merge_tile_holds_the_group_unless_too_large():
    from gyrfalcon.kernels.split_merge import MERGE_TILE, merge_heads_per_tile

    assert merge_heads_per_tile(4, 16, 128) == 4  # Llama-3.1-8B at batch 1: one tile
    assert merge_heads_per_tile(3, 16, 64) == 4  # SmolLM2 (padded to a power of two)
    assert merge_heads_per_tile(16, 16, 128) == 4
    assert merge_heads_per_tile(8, 16, 256) == 2
    assert merge_heads_per_tile(1, 16, 1024) == 1
    for g, s, d in [(4, 16, 128), (16, 16, 128), (8, 16, 256), (5, 3, 64)]:
        n = merge_heads_per_tile(g, s, d)
        assert n & (n - 1) == 0 and n * 16 * d <= max(MERGE_TILE, 16 * d)


def test_decode_kv_splits_fill_the_gpu_a_few_times_over():
    # 132 SMs (H100/H200), 4 programs per SM: Llama-8B (8 KV heads) and SmolLM2 (3)
    assert [decode_kv_splits(bs, 8, 132) for bs in (1, 4, 8, 16, 32, 64, 256)] == [
        16, 16, 8, 4, 2, 1, 1,
    ]  # fmt: skip
    assert [decode_kv_splits(bs, 3, 132) for bs in (1, 8, 32, 64, 256)] == [16, 16, 4, 2, 1]
    for kvh in (1, 2, 3, 8, 16):
        splits = [decode_kv_splits(bs, kvh, 132) for bs in range(1, 300)]
        assert all(a >= b for a, b in zip(splits, splits[1:])), "non-increasing in bs"
        assert all(1 <= s <= MAX_KV_SPLITS and s & (s - 1) == 0 for s in splits)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_decode_auto_splits_match_ref(kv_heads):
    spec = [(n - 1, 1) for n in DECODE_LENS]
    out, expect, tb = run_both(spec, 4, kv_heads, 64, ForwardMode.DECODE, decode_block_n=16)
    # the interpreter's nominal 8 SMs: 7 rows x kv_heads x splits <= 32
    assert tb.attn_meta.scratch.num_kv_splits == decode_kv_splits(len(spec), kv_heads, 8)
    torch.testing.assert_close(out, expect, **TOL)


def test_decode_default_blocks_many_empty_splits():
    # default block sizes (64 keys) with 16 splits: every row leaves most splits empty
    spec = [(n - 1, 1) for n in [1, 5, 63, 64, 65, 200]]
    out, expect, _ = run_both(spec, 4, 1, 64, ForwardMode.DECODE, num_kv_splits=16)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expect, **TOL)


@pytest.mark.parametrize("head_dim", [8, 32, 80, 256])
def test_other_head_dims(head_dim):
    # powers of two below 64 and up to 256, and a non-power of two (masked lanes)
    spec = [(n - 1, 1) for n in [1, 9, 30]]
    out, expect, _ = run_both(
        spec, 4, 2, head_dim, ForwardMode.DECODE, num_kv_splits=2, decode_block_n=16
    )
    torch.testing.assert_close(out, expect, **TOL)
    spec = [(0, 5), (6, 3), (2, 1)]
    out, expect, _ = run_both(spec, 4, 2, head_dim, ForwardMode.MIXED, extend_block_m=16)
    torch.testing.assert_close(out, expect, **TOL)


def test_decode_padded_rows_leave_real_rows_unchanged():
    spec = [(n - 1, 1) for n in [7, 1, 20]]
    kw = dict(num_kv_splits=4, decode_block_n=16)
    alone, expect, _ = run_both(spec, 6, 2, 64, ForwardMode.DECODE, **kw)
    padded, _, tb = run_both(spec, 6, 2, 64, ForwardMode.DECODE, pad_rows=3, **kw)
    assert padded.shape[0] == 6 and tb.seq_lens_cpu[3:] == [1, 1, 1]
    assert (tb.page_table[3:] == 0).all()
    torch.testing.assert_close(padded[:3], alone, atol=0, rtol=0)
    torch.testing.assert_close(padded[:3], expect, **TOL)
    assert torch.isfinite(padded).all()


# extend rows (prefix, q_len): fresh prefill, chunks after a cached prefix (one
# crossing several 16-query blocks), verify rows (k + 1 = 4), a decode row
EXTEND_SPEC = [(0, 7), (9, 5), (3, 37), (12, 4), (PS - 1, 4), (5, 1), (0, 1)]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(2, 2, 64), (3, 1, 64), (8, 2, 128), (8, 1, 64)],
)
def test_extend_matches_ref(heads, kv_heads, head_dim):
    out, expect, tb = run_both(
        EXTEND_SPEC,
        heads,
        kv_heads,
        head_dim,
        ForwardMode.MIXED,
        extend_block_m=16,
        extend_block_n=16,
    )
    assert not tb.attn_meta.is_decode and tb.attn_meta.max_q_len == 37
    torch.testing.assert_close(out, expect, **TOL)


@pytest.mark.parametrize("k", [1, 3])
def test_verify_batch_matches_ref(k):
    # every row scores its last accepted token plus k drafts, prefixes at page edges
    spec = [(prefix, k + 1) for prefix in [1, PS - 1, PS, 2 * PS + 1, 30]]
    out, expect, tb = run_both(spec, 4, 1, 64, ForwardMode.VERIFY, pad_rows=2)
    # NOTE: the padded rows' single tokens make the rows uneven: the extend kernel
    assert tb.attn_meta.max_q_len == k + 1 and tb.attn_meta.verify_tokens == 0
    n_real = len(spec) * (k + 1)
    torch.testing.assert_close(out[:n_real], expect[:n_real], **TOL)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float8_e4m3fn])
def test_verify_rows_on_the_decode_kernel_and_uneven_ones_on_the_extend_kernel(kv_dtype):
    """Verify rows of k + 1 tokens each run on the decode kernel (a program row per
    query token, its length the row's minus the tokens after it), with several KV
    splits and an fp8 cache too; rows with fewer drafts (uneven q_lens) on the extend
    kernel. Both match torch_ref."""
    even = [(prefix, 4) for prefix in [1, PS - 1, 2 * PS + 1, 30]]
    uneven = [(12, 4), (7, 2), (30, 3)]
    kw = dict(num_kv_splits=4, decode_block_n=16, extend_block_m=16, extend_block_n=16)
    for spec, t in ((even, 4), (uneven, 0)):
        out, expect, tb = run_both(spec, 8, 2, 64, ForwardMode.VERIFY, kv_dtype=kv_dtype, **kw)
        assert tb.attn_meta.verify_tokens == t
        tol = TOL if kv_dtype == torch.float32 else dict(atol=0.05, rtol=0.05)
        torch.testing.assert_close(out, expect, **tol)


FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.MIXED])
def test_fp8_kv_cache_matches_ref_and_stays_near_full_precision(mode):
    spec = [(n - 1, 1) for n in DECODE_LENS] if mode is ForwardMode.DECODE else EXTEND_SPEC
    kw = dict(num_kv_splits=4, decode_block_n=16, extend_block_m=16, extend_block_n=16)
    out, expect, tb = run_both(spec, 8, 2, 64, mode, kv_dtype=FP8, **kw)
    assert tb.kv_cache.k.dtype == FP8 and out.dtype == torch.float32
    torch.testing.assert_close(out, expect, **TOL)  # same fp8 values read by both
    # against a float32 cache holding what the fp8 one rounded: e4m3 keeps 3 mantissa
    # bits, so attention outputs move by a few percent of their scale, not more
    full, _, _ = run_both(spec, 8, 2, 64, mode, **kw)
    err = (out - full).abs().max() / full.abs().max()
    assert 0 < err < 0.08, err


def test_fp8_decode_with_bf16_queries_in_float16_math():
    """bf16 queries on an fp8 cache, dots in float16 (the default there): within bf16
    rounding of float32 attention over the same fp8 values.

    NOTE: the interpreter's fp8 -> bf16 conversion is wrong (test/gpu covers the
    bf16 math on the GPU); its fp8 -> float16 one is right."""
    from gyrfalcon.kernels.attention_decode import alloc_decode_scratch, decode_attention

    gen = torch.Generator().manual_seed(4)
    lens, heads, kvh, d = [1, 7, 18, 33], 8, 2, 64
    pages = [-(-n // PS) for n in lens]
    table = torch.zeros(len(lens), max(pages), dtype=torch.int64)
    first = 1
    for i, n in enumerate(pages):
        table[i, :n] = torch.arange(first, first + n)
        first += n
    k = (2 * torch.randn(first * PS, kvh, d, generator=gen)).to(FP8)
    v = (2 * torch.randn(first * PS, kvh, d, generator=gen)).to(FP8)
    q = (3 * torch.randn(len(lens), heads, d, generator=gen)).bfloat16()
    o = torch.empty_like(q)
    scratch = alloc_decode_scratch(len(lens), heads, d, 2, CPU)
    seq = torch.tensor(lens)
    decode_attention(q, k, v, table, seq, o, scratch, PS, d**-0.5, 16)
    for i, n in enumerate(lens):
        slots = (table[i, :, None] * PS + torch.arange(PS)).reshape(-1)[:n]
        kk = k[slots].float().repeat_interleave(heads // kvh, 1)  # [n, H, D]
        vv = v[slots].float().repeat_interleave(heads // kvh, 1)
        w = torch.einsum("hd,nhd->hn", q[i].float(), kk).mul(d**-0.5).softmax(-1)
        ref = torch.einsum("hn,nhd->hd", w, vv)
        torch.testing.assert_close(o[i].float(), ref, atol=0.03, rtol=0.02)


def test_extend_default_blocks_long_prefill():
    out, expect, _ = run_both([(0, 70), (50, 20)], 4, 2, 64, ForwardMode.PREFILL)
    torch.testing.assert_close(out, expect, **TOL)


def test_replay_metadata_views_the_graph_runners_static_batch():
    """capture_buffers + prepare_replay on the graph runner's static buffers: the
    metadata views them (no copies), so every replay of one size reads the same
    tensors, refilled in place, and attention matches torch_ref for each fill."""
    from gyrfalcon.worker.cuda_graph import GraphKey, StaticBuffers

    tri = TritonBackend(4, 2, 64, 64**-0.5, num_kv_splits=4, decode_block_n=16)
    tri.capture_buffers(max_bs=8, max_pages=16, device=CPU)
    buf = StaticBuffers.allocate(8, 16, PS, CPU)
    key = GraphKey(ForwardMode.DECODE, 6, 1)
    ref = TorchRefBackend(4, 2, 64, 64**-0.5)
    ptrs = set()
    for seed, lens in enumerate([[5, 1, 33, 2, 9], [17, 2, 8, 4, 40]]):
        cache, rows = make_case([(n - 1, 1) for n in lens], 2, 64, seed, pad_rows=1)
        bt = build_batch_tensors(rows, PS, CPU)
        tb = buf.forward_batch(key, buf.fill(bt, key), cache, tri)
        tb.attn_meta = tri.prepare_replay(tb)
        meta = tb.attn_meta
        assert meta.is_decode and meta.page_table.data_ptr() == buf.page_table.data_ptr()
        ptrs.add((meta.page_table.data_ptr(), meta.seq_lens.data_ptr()))
        rb = make_batch(rows, cache, ref, ForwardMode.DECODE)
        q = torch.randn(len(rows), 4, 64)
        k, v = torch.randn(len(rows), 2, 64), torch.randn(len(rows), 2, 64)
        out = tri.forward(q, k, v, LAYER, tb)
        expect = ref.forward(q, k, v, LAYER, rb)
        torch.testing.assert_close(out[: len(lens)], expect[: len(lens)], **TOL)
    assert len(ptrs) == 1, "replays of one size must read the same tensors"


@pytest.mark.parametrize("k", [1, 3])
def test_verify_replay_metadata_views_the_static_batch(k):
    """A VERIFY key: the decode kernel, a program row per query token, reads the static
    buffers' page table and lengths (its grid and scratch depend on the key alone:
    padded rows x (k + 1)); two fills of one key read the same tensors and match
    torch_ref on the real rows."""
    from gyrfalcon.worker.cuda_graph import GraphKey, StaticBuffers

    t, padded = k + 1, 4
    tri = TritonBackend(4, 2, 64, 64**-0.5, extend_block_m=16, extend_block_n=16)
    tri.capture_buffers(8, 16, CPU, ForwardMode.VERIFY, t)
    buf = StaticBuffers.allocate(8, 16, PS, CPU, tokens_per_row=(1, t))
    ref = TorchRefBackend(4, 2, 64, 64**-0.5)
    key = GraphKey(ForwardMode.VERIFY, padded, t)
    ptrs = set()
    for seed, prefixes in enumerate([[1, PS - 1, 2 * PS + 1], [9, 30, 2]]):
        cache, rows = make_case([(p, t) for p in prefixes], 2, 64, seed)
        bt = build_batch_tensors(rows, PS, CPU)
        tb = buf.forward_batch(key, buf.fill(bt, key), cache, tri)
        tb.attn_meta = meta = tri.prepare_replay(tb)
        assert meta.max_q_len == t and meta.num_decode == 0 and meta.verify_tokens == t
        assert meta.scratch is not None and meta.scratch.mid_o.shape[0] >= padded * t
        assert meta.q_starts.tolist() == [0, t, 2 * t, 3 * t] and meta.q_lens.tolist() == [t] * 4
        assert meta.page_table.data_ptr() == buf.page_table.data_ptr()
        ptrs.add((meta.page_table.data_ptr(), meta.seq_lens.data_ptr(), meta.q_starts.data_ptr()))
        assert not tri.fuses_rope(tb)
        padded_rows = rows + [RowInput(0, [0] * t, [0])] * (padded - len(rows))
        rb = make_batch(padded_rows, cache, ref, ForwardMode.VERIFY)
        n = len(rows) * t
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(padded * t, 4, 64, generator=gen)
        k_new, v_new = torch.randn(padded * t, 2, 64, generator=gen), torch.randn(padded * t, 2, 64)
        out = tri.forward(q, k_new, v_new, LAYER, tb)
        expect = ref.forward(q, k_new, v_new, LAYER, rb)
        torch.testing.assert_close(out[:n], expect[:n], **TOL)
        assert torch.isfinite(out).all()
    assert len(ptrs) == 1, "replays of one key must read the same tensors"


def test_metadata_rejects_inconsistent_batches():
    cache, rows = make_case([(3, 1), (8, 1)], 2, 64, 0)
    tri = TritonBackend(4, 2, 64, 0.125)
    batch = make_batch(rows, cache, tri, ForwardMode.DECODE)
    # a multi-step slot list [bs * steps] against [bs] lengths (spec bug class 4)
    batch.out_cache_loc = torch.cat([batch.out_cache_loc, batch.out_cache_loc])
    with pytest.raises(AssertionError):
        tri.build_metadata(batch)
    batch = make_batch(rows, cache, tri, ForwardMode.DECODE)
    batch.seq_lens_cpu = [4, 0]  # a zero length (spec bug class 5)
    with pytest.raises(AssertionError):
        tri.build_metadata(batch)
    batch = make_batch(rows, cache, tri, ForwardMode.DECODE)
    batch.seq_lens_cpu = [4, 9 * PS]  # beyond the row's page capacity
    with pytest.raises(AssertionError):
        tri.build_metadata(batch)


def test_registry_creates_triton():
    backend = create_backend("triton", 8, 2, 64, 0.125)
    assert isinstance(backend, TritonBackend) and backend.name == "triton"
    assert backend.supports_cuda_graph


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.MIXED])
def test_q_as_a_strided_view_of_qkv(mode):
    """The model hands q over as a view of its fused qkv projection: no copy is made,
    and the result equals the contiguous q's, for 1 split (direct store) and several."""
    heads, kv_heads, d = 4, 2, 64
    spec = [(n - 1, 1) for n in [3, 18, 40]] if mode is ForwardMode.DECODE else EXTEND_SPEC
    for splits in (1, 4):
        cache, rows = make_case(spec, kv_heads, d, seed=5)
        tri = TritonBackend(heads, kv_heads, d, d**-0.5, num_kv_splits=splits, extend_block_m=16)
        batch = make_batch(rows, cache, tri, mode)
        T = batch.num_tokens
        qkv = torch.randn(T, (heads + 2 * kv_heads) * d, generator=torch.Generator().manual_seed(6))
        q, k, v = (t.view(T, -1, d) for t in qkv.split([heads * d, kv_heads * d, kv_heads * d], -1))
        assert not q.is_contiguous()
        got = tri.forward(q, k, v, LAYER, batch)
        want = tri.forward(q.contiguous(), k, v, LAYER, batch)
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8])
def test_mixed_batch_runs_leading_decode_rows_on_the_decode_kernel(kv_dtype):
    # decodes first (as the scheduler orders them), then prefill chunks, then a
    # one-token row after an extend row (it stays with the extend kernel)
    decodes = [(n - 1, 1) for n in (1, PS, 2 * PS + 3, 45)]
    spec = decodes + [(0, 9), (6, 20), (3, 1)]
    kw = dict(num_kv_splits=4, decode_block_n=16, extend_block_m=16, extend_block_n=16)
    kw["one_launch_max_kv_bytes"] = 0
    out, expect, tb = run_both(spec, 8, 2, 64, ForwardMode.MIXED, kv_dtype=kv_dtype, **kw)
    meta = tb.attn_meta
    assert meta.num_decode == 4 and not meta.is_decode and meta.max_q_len == 20
    torch.testing.assert_close(out, expect, **TOL)
    assert meta.scratch is not None and meta.scratch.num_kv_splits == 4


@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8])
def test_mixed_batch_with_little_decode_kv_runs_in_one_extend_launch(kv_dtype, monkeypatch):
    """A prompt arriving beside a few short decode rows: every row, the decodes as
    extend rows of one token, in one extend launch a layer (an eager step is bound by
    its launches); past ONE_LAUNCH_MAX_KV_BYTES of decode KV reads (per query head) the
    decode rows go back to the decode kernel. Both equal the reference."""
    from gyrfalcon.layers.attention import triton_backend

    launches = []
    for name in ("decode_attention", "extend_attention"):
        real = getattr(triton_backend, name)

        def record(*args, _name=name, _real=real, **kw):
            launches.append(_name)
            return _real(*args, **kw)

        monkeypatch.setattr(triton_backend, name, record)
    decodes = [(n - 1, 1) for n in (1, PS, 2 * PS + 3, 45)]
    spec = decodes + [(0, 9), (6, 20), (3, 1)]
    kw = dict(num_kv_splits=4, decode_block_n=16, extend_block_m=16, extend_block_n=16)
    heads, d = 8, 64
    per_token = 2 * heads * d * (1 if kv_dtype == FP8 else 4)
    decode_kv = sum(n + 1 for n in (0, PS - 1, 2 * PS + 2, 44)) * per_token
    for limit, want_nd, want in ((decode_kv, 0, ["extend_attention"]),
                                 (decode_kv - 1, 4, ["decode_attention", "extend_attention"])):  # fmt: skip
        launches.clear()
        out, expect, tb = run_both(
            spec, heads, 2, d, ForwardMode.MIXED, kv_dtype=kv_dtype,
            one_launch_max_kv_bytes=limit, **kw,
        )  # fmt: skip
        meta = tb.attn_meta
        assert meta.num_decode == want_nd and meta.max_q_len == 20 and launches == want
        assert (meta.scratch is None) == (want_nd == 0)
        torch.testing.assert_close(out, expect, **TOL)


@pytest.mark.parametrize("num_decode", [1, 2, 3])
def test_mixed_batch_extend_rows_start_aligned_whatever_the_decode_count(num_decode):
    # Triton builds a kernel per pointer-alignment class: the extend rows' index tensors
    # start 16-byte aligned after any number of decode rows (views at row num_decode
    # would not), so mixed steps never build the extend kernel again while serving
    spec = [(n, 1) for n in (4, 7, 9)[:num_decode]] + [(0, 9), (5, 3)]
    kw = dict(num_kv_splits=2, one_launch_max_kv_bytes=0)
    out, expect, tb = run_both(spec, 8, 2, 64, ForwardMode.MIXED, **kw)
    meta = tb.attn_meta
    assert meta.num_decode == num_decode and meta.max_q_len == 9
    torch.testing.assert_close(out, expect, **TOL)
    for t in (meta.ext_page_table, meta.ext_seq_lens, meta.q_starts, meta.q_lens):
        assert t.data_ptr() % 16 == 0 and t.shape[0] == 2


@pytest.mark.parametrize(
    "kv_heads,head_dim,splits,kv_dtype",
    [(2, 64, 1, torch.float32), (2, 64, 4, torch.float32), (1, 96, 3, FP8), (4, 128, 2, FP8)],
)
def test_decode_with_rope_in_the_kernel(kv_heads, head_dim, splits, kv_dtype):
    """attend_rope (RoPE of q and k, and the K/V write, inside the decode kernel) equals
    the torch rotary, the K/V store kernel and torch_ref attention, and leaves the same
    cache. NOTE: the store kernel stands in for KVCache.write because triton's
    interpreter converts some values to fp8 differently from torch (the GPU test
    compares with torch)."""
    from gyrfalcon.kernels.kv_store import store_kv
    from gyrfalcon.kernels.rotary import build_cos_sin_cache
    from gyrfalcon.layers.context import LayerContext
    from gyrfalcon.layers.rotary import RotaryEmbedding

    heads = 2 * kv_heads
    spec = [(n - 1, 1) for n in (1, PS, PS + 1, 29, 61)]
    (cache, rows), (ref_cache, _) = (
        make_case(spec, kv_heads, head_dim, 9, pad_rows=2, kv_dtype=kv_dtype) for _ in range(2)
    )
    tri = TritonBackend(heads, kv_heads, head_dim, head_dim**-0.5, num_kv_splits=splits)
    ref = TorchRefBackend(heads, kv_heads, head_dim, head_dim**-0.5)
    tb = make_batch(rows, cache, tri, ForwardMode.DECODE)
    rb = make_batch(rows, ref_cache, ref, ForwardMode.DECODE)
    assert tri.fuses_rope(tb)
    gen = torch.Generator().manual_seed(10)
    q, k, v = (
        torch.randn(len(rows), h, head_dim, generator=gen) for h in (heads,) + 2 * (kv_heads,)
    )
    rope = RotaryEmbedding(head_dim, 10000.0, None, 128, LayerContext())
    cos_sin = build_cos_sin_cache(rope.inv_freq, 128)
    out = tri.attend_rope(q, k, v, tb.positions, cos_sin, LAYER, tb)
    q_rot, k_rot = rope(rb.positions, q, k)
    store_kv(k_rot, v, ref_cache.k[LAYER], ref_cache.v[LAYER], rb.out_cache_loc)
    expect = ref.attend(q_rot, LAYER, rb)
    n = len(spec)  # padded rows share the dummy slot: only real rows are compared
    torch.testing.assert_close(out[:n], expect[:n], **TOL)
    slots = tb.out_cache_loc[:n]
    for got, want in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
        torch.testing.assert_close(got[LAYER][slots].float(), want[LAYER][slots].float(), **TOL)
    assert not tb.attn_meta.scratch.counts.any()


def test_warm_up_launches_the_decode_kernel_at_every_split_count_of_eager_rows(monkeypatch):
    """A MIXED step's decode rows run the decode kernel without RoPE at a split count
    that depends on their number; each count is its own kernel build, so the warm-up
    launches every count 1..max_rows rows can pick (the interpreter's 8 SMs: 32
    programs), with q a view of a qkv row as `attend` gets it."""
    from gyrfalcon.layers.attention import triton_backend

    launches = []
    real = triton_backend.decode_attention

    def record(q, *args, **kw):
        launches.append((q.shape[0], args[5].num_kv_splits, q.stride(0), kw.get("rope")))
        return real(q, *args, **kw)

    monkeypatch.setattr(triton_backend, "decode_attention", record)
    heads, kv_heads, d = 4, 2, 16
    tri = TritonBackend(heads, kv_heads, d, d**-0.5, decode_block_n=16)
    cache = KVCache(2, 8, PS, kv_heads, d, torch.float32, CPU)
    tri.warm_up_kernels(cache, torch.float32, 20, PS)
    want = {decode_kv_splits(n, kv_heads, 8) for n in range(1, 21)}
    assert {splits for _, splits, _, _ in launches} == want == {1, 2, 4, 8, 16}
    assert len(launches) == len(want)
    for rows, splits, stride, rope in launches:
        assert decode_kv_splits(rows, kv_heads, 8) == splits and rope is None
        # NOTE: Triton specializes an int on == 1 and % 16: a qkv row's width or, for
        # a single row, the contiguous H * D (torch's stride of a size-1 dim)
        assert stride in ((heads + 2 * kv_heads) * d, heads * d) and stride % 16 == 0
