"""Triton attention backend (Triton interpreter on CPU): its metadata for CUDA-graph
replay, mixed batches of decode and extend rows, RoPE inside the decode kernel; against
torch_ref where outputs are compared. The warm-up's kernel builds: test_triton_warmup.py."""

import pytest
import torch
from triton_attention_cases import (  # NOTE: sets TRITON_INTERPRET
    CPU,
    EXTEND_SPEC,
    FP8,
    LAYER,
    PS,
    TOL,
    make_batch,
    make_case,
    make_replay_batch,
    run_both,
)

from gyrfalcon.forward.metadata import RowInput, build_batch_tensors
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.registry import create_backend
from gyrfalcon.layers.attention.torch_ref import TorchRefBackend
from gyrfalcon.layers.attention.triton_backend import TritonBackend


def test_replay_metadata_views_the_graph_runners_static_batch():
    """capture_buffers + prepare_replay on the graph runner's static buffers: the
    metadata views them (no copies), so every replay of one size reads the same
    tensors, refilled in place, and attention matches torch_ref for each fill."""
    from gyrfalcon.worker.static_buffers import GraphKey, StaticBuffers

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
    """A VERIFY key: the decode kernel, one program row per row holding its k + 1 tokens
    (packed), reads the static buffers' page table and lengths (its grid and scratch
    depend on the key alone: padded rows, x (k + 1) scratch rows); two fills of one key
    read the same tensors and match torch_ref on the real rows. Packed verify rows may
    take RoPE inside the kernel (`attend_rope`)."""
    from gyrfalcon.worker.static_buffers import GraphKey, StaticBuffers

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
        assert meta.packed and tri.fuses_rope(tb)
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


@pytest.mark.parametrize("t", [1, 4])
def test_replay_metadata_depends_on_the_key_alone(t):
    """Why a CUDA-graph replay on triton may skip prepare_replay (`replay_plans` False):
    for one key, the metadata of a fill with other rows and lengths is the capture's own,
    field for field (the same tensors, shapes and strides; the same host values), and
    preparing it writes nothing. So the captured kernels read all a new prepare would
    give them."""
    from dataclasses import fields

    from gyrfalcon.worker.static_buffers import GraphKey, StaticBuffers

    assert not TritonBackend.replay_plans
    mode = ForwardMode.DECODE if t == 1 else ForwardMode.VERIFY
    tri = TritonBackend(4, 2, 64, 64**-0.5)
    tri.capture_buffers(8, 16, CPU, mode, t)
    buf = StaticBuffers.allocate(8, 16, PS, CPU, tokens_per_row=tuple(sorted({1, t})))
    key = GraphKey(mode, 4, t)

    def described(meta) -> list:
        out = []
        for f in fields(meta):
            v = getattr(meta, f.name)
            if isinstance(v, torch.Tensor):
                v = (v.data_ptr(), v.shape, v.stride(), v.dtype)
            elif f.name == "scratch":
                v = None if v is None else id(v)
            out.append((f.name, v))
        return out

    capture = described(tri.prepare_replay(buf.forward_batch(key, buf.fill(None, key), None, tri)))
    for seed, prefixes in enumerate([[3, PS + 2], [40, 1, 7]]):
        cache, rows = make_case([(p, t) for p in prefixes], 2, 64, seed)
        batch = buf.forward_batch(
            key, buf.fill(build_batch_tensors(rows, PS, CPU), key), cache, tri
        )
        before = [x.clone() for x in (buf.tokens, buf.seq_lens, buf.page_table)]
        assert described(tri.prepare_replay(batch)) == capture
        after = (buf.tokens, buf.seq_lens, buf.page_table)
        assert all(torch.equal(a, b) for a, b in zip(before, after)), "prepare wrote buffers"


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


def _rope_inside_and_apart(tri, tb, ref, rb, ref_cache, q, k, v):
    """(attend_rope on tb: RoPE and the K/V write inside the decode kernel; the torch
    rotary, the K/V store kernel and torch_ref attention on rb)."""
    from gyrfalcon.kernels.kv_store import store_kv
    from gyrfalcon.kernels.rotary import build_cos_sin_cache
    from gyrfalcon.layers.context import LayerContext
    from gyrfalcon.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(q.shape[-1], 10000.0, None, 128, LayerContext())
    cos_sin = build_cos_sin_cache(rope.inv_freq, 128)
    out = tri.attend_rope(q, k, v, tb.positions, cos_sin, LAYER, tb)
    q_rot, k_rot = rope(rb.positions, q, k)
    store_kv(k_rot, v, ref_cache.k[LAYER], ref_cache.v[LAYER], rb.out_cache_loc)
    return out, ref.attend(q_rot, LAYER, rb)


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
    out, expect = _rope_inside_and_apart(tri, tb, ref, rb, ref_cache, q, k, v)
    n = len(spec)  # padded rows share the dummy slot: only real rows are compared
    torch.testing.assert_close(out[:n], expect[:n], **TOL)
    slots = tb.out_cache_loc[:n]
    for got, want in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
        torch.testing.assert_close(got[LAYER][slots].float(), want[LAYER][slots].float(), **TOL)
    assert not tb.attn_meta.scratch.counts.any()


@pytest.mark.parametrize("splits,kv_dtype", [(1, torch.float32), (3, torch.float32), (2, FP8)])
def test_packed_verify_rows_with_rope_in_the_kernel(splits, kv_dtype):
    """Verify rows of k + 1 = 4 tokens through attend_rope (every token's q and k
    rotated at its own position, the row's new K/V written by the programs whose
    splits hold them, each token attending to its causal prefix) equal the torch
    rotary, the K/V store kernel and torch_ref attention, and leave the same cache;
    rows straddle pages and splits (a split where the row's first tokens see no key).
    Packed rows run under graphs only: the same rows eagerly take RoPE apart."""
    kv_heads, head_dim, t = 2, 64, 4
    heads = 3 * kv_heads  # NOTE: a group of 3 (SmolLM2's): 12 of the block's 16 rows
    spec = [(p, t) for p in (1, PS - 2, 2 * PS + 1, 29, 44)]
    (cache, rows), (ref_cache, _) = (
        make_case(spec, kv_heads, head_dim, 11, kv_dtype=kv_dtype) for _ in range(2)
    )
    tri = TritonBackend(
        heads, kv_heads, head_dim, head_dim**-0.5, num_kv_splits=splits, decode_block_n=16
    )
    ref = TorchRefBackend(heads, kv_heads, head_dim, head_dim**-0.5)
    eager = make_batch(rows, cache, tri, ForwardMode.VERIFY)
    assert eager.attn_meta.verify_tokens == t and not tri.fuses_rope(eager)
    tb = make_replay_batch(rows, cache, tri, ForwardMode.VERIFY)
    rb = make_batch(rows, ref_cache, ref, ForwardMode.VERIFY)
    assert tb.attn_meta.verify_tokens == t and tb.attn_meta.packed and tri.fuses_rope(tb)
    gen = torch.Generator().manual_seed(12)
    n = len(rows) * t
    q, k, v = (torch.randn(n, h, head_dim, generator=gen) for h in (heads,) + 2 * (kv_heads,))
    out, expect = _rope_inside_and_apart(tri, tb, ref, rb, ref_cache, q, k, v)
    tol = TOL if kv_dtype == torch.float32 else dict(atol=0.05, rtol=0.05)
    torch.testing.assert_close(out, expect, **tol)
    slots = tb.out_cache_loc
    for got, want in ((cache.k, ref_cache.k), (cache.v, ref_cache.v)):
        torch.testing.assert_close(got[LAYER][slots].float(), want[LAYER][slots].float(), **TOL)
    assert not tb.attn_meta.scratch.counts.any()


def _static_rows_batch(bt, cache, backend, rows_buf, table, num_tokens):
    """The real rows of bt copied into static buffers of R rows (spare rows q_len 0) and
    num_tokens tokens (padding on the dummy page's first slot), as a whole piecewise
    graph holds them (worker/piecewise_graph.py)."""
    from gyrfalcon.forward.batch import ForwardBatch, decode_rows
    from gyrfalcon.worker.piecewise_graph import fill_static_rows

    bs, n, r = len(bt.seq_lens_cpu), bt.input_ids.shape[0], rows_buf.shape[1]
    nd = decode_rows(ForwardMode.MIXED, bt.leading_single_rows, bs)
    fill_static_rows(rows_buf, table, bt, nd)
    tokens = torch.zeros(3, num_tokens, dtype=torch.int64)
    tokens[:, :n] = bt.token_rows
    batch = ForwardBatch(
        mode=ForwardMode.MIXED, input_ids=tokens[0], positions=tokens[1],
        out_cache_loc=tokens[2], seq_lens=rows_buf[0], q_lens=rows_buf[1],
        q_starts=rows_buf[2], page_table=table, seq_lens_cpu=[table.shape[1] * PS] * r,
        q_lens_cpu=[1] * r, page_size=PS, kv_cache=cache, attn_backend=backend,
        num_decode_rows=0,
    )  # fmt: skip
    batch.attn_meta = backend.prepare_any_rows(batch, rows_buf[3, : min(r, num_tokens)])
    return batch


def test_any_rows_metadata_serves_every_fill_of_one_static_batch():
    """One static batch of 10 rows and 96 tokens (a whole graph's): ragged extend rows,
    then decodes beside extend rows, each copied in with the rest of the rows spare
    (q_len 0); the decode kernel over the decode rows and the flat grid over the rest
    attend exactly as torch_ref over the real tokens, the padding tokens get zeros, and
    both fills read the same tensors."""
    heads, kvh, d = 4, 2, 32
    tri = TritonBackend(heads, kvh, d, d**-0.5)
    ref = TorchRefBackend(heads, kvh, d, d**-0.5)
    rows_buf = torch.ones(4, 10, dtype=torch.int64)
    table = torch.zeros(10, 16, dtype=torch.int64)
    ptrs = set()
    specs = [EXTEND_SPEC, [(5, 1), (30, 1), (0, 9), (12, 4), (7, 22)]]
    for seed, spec in enumerate(specs):
        cache, rows = make_case(spec, kvh, d, seed)
        bt = build_batch_tensors(rows, PS, CPU)
        n = bt.input_ids.shape[0]
        tb = _static_rows_batch(bt, cache, tri, rows_buf, table, 96)
        meta = tb.attn_meta
        assert meta.flat and meta.num_decode == 0 and not meta.is_decode
        # NOTE: the second fill's two leading rows of one token take the decode kernel
        assert meta.flat_decode_lens.gt(0).sum() == (2 if seed == 1 else 0)
        ptrs.add((meta.page_table.data_ptr(), meta.q_lens.data_ptr(), meta.seq_lens.data_ptr()))
        gen = torch.Generator().manual_seed(seed)
        q = torch.randn(96, heads, d, generator=gen)
        k, v = torch.randn(96, kvh, d, generator=gen), torch.randn(96, kvh, d, generator=gen)
        rb = make_batch(rows, cache, ref, ForwardMode.MIXED)
        expect = ref.forward(q[:n], k[:n], v[:n], LAYER, rb)
        out = tri.forward(q, k, v, LAYER, tb)
        torch.testing.assert_close(out[:n], expect, **TOL)
        assert out[n:].eq(0).all(), "padding tokens belong to no row"
    assert len(ptrs) == 1, "every fill is read through the same tensors"


def test_any_rows_graphs_serve_every_batch_but_verify_rows():
    """`any_rows_fit`: extend rows and prefill fit; decode rows beside them fit whether
    or not an eager step's extend launch would take them (ONE_LAUNCH_MAX_KV_BYTES: the
    graph runs them on the decode kernel); uniform verify rows (the decode kernel's rows
    of T tokens) never."""
    tri = TritonBackend(4, 2, 32, 32**-0.5)
    cache, rows = make_case([(0, 7), (9, 5)], 2, 32, 0)
    assert tri.any_rows_fit(make_batch(rows, cache, tri, ForwardMode.PREFILL))
    cache, rows = make_case([(20, 1), (0, 6)], 2, 32, 0)
    assert tri.any_rows_fit(make_batch(rows, cache, tri, ForwardMode.MIXED))
    tri.one_launch_max_kv_bytes = 0
    assert tri.any_rows_fit(make_batch(rows, cache, tri, ForwardMode.MIXED))
    cache, rows = make_case([(20, 4), (3, 4)], 2, 32, 0)
    assert not tri.any_rows_fit(make_batch(rows, cache, tri, ForwardMode.VERIFY))
