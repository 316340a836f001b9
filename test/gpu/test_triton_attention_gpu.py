"""Triton attention backend on CUDA in bf16 at realistic sizes, against torch_ref in fp32.

Run on the GPU machine: `pytest test/gpu/test_triton_attention_gpu.py -m gpu`.

NOTE: the Triton kernels are imported inside the fixture, never at module level:
collecting this file on a CPU machine must not decorate them in compiled mode
before the CPU unit tests switch Triton to its interpreter.
"""

import importlib
import importlib.util

import pytest
import torch
from paged_cases import paged_batch, paged_case, replay_batch

from gyrfalcon.forward.metadata import RowInput, build_batch_tensors
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.torch_ref import TorchRefBackend
from gyrfalcon.worker.static_buffers import GraphKey, StaticBuffers

pytestmark = pytest.mark.gpu

PS = 16
LAYER = 1
# bf16 inputs and bf16 probabilities in the PV product vs an fp32 oracle
TOL = dict(atol=2e-2, rtol=2e-2)


def _interpreted(module) -> bool:
    return any(type(v).__name__ == "InterpretedFunction" for v in vars(module).values())


@pytest.fixture(scope="module")
def triton_backend_cls():
    """TritonBackend with its kernels compiled for the GPU.

    NOTE: CPU unit tests collected in the same session may have set
    TRITON_INTERPRET=1 and imported kernel modules under it (triton picks
    interpreter vs compiler at import and consults the flag while compiling), so
    the flag is unset for this module and interpreted kernel modules are reloaded
    in place (functions that already reference them see the compiled kernels).
    """
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("triton")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        # NOTE: dependencies first (attention_decode imports kv_store's and rotary's jit
        # functions at its import)
        names = ("pdl", "kv_store", "rotary", "split_merge", "attention_decode")
        for name in names + ("attention_extend",):
            full = f"gyrfalcon.kernels.{name}"
            if importlib.util.find_spec(full) is None:
                continue
            module = importlib.import_module(full)
            if _interpreted(module):
                importlib.reload(module)
            assert not _interpreted(module), f"{full} is still interpreted"
        from gyrfalcon.layers.attention.triton_backend import TritonBackend

        yield TritonBackend


def make_case(spec, kv_heads, head_dim, seed, pad_rows=0, kv_dtype=torch.bfloat16):
    """`paged_case` at this module's page size on a bf16 (or fp8) cache on the GPU."""
    dev = torch.device("cuda")
    return paged_case(spec, kv_heads, head_dim, PS, seed, pad_rows, kv_dtype, dev, spare_pages=7)


def make_batch(rows, cache, backend, mode):
    return paged_batch(rows, cache, backend, mode, PS)


def compare(
    cls, spec, heads, kv_heads, head_dim, mode, pad_rows=0, seed=0, kv_dtype=torch.bfloat16, **kw
):
    torch.manual_seed(seed)
    cache, rows = make_case(spec, kv_heads, head_dim, seed, pad_rows, kv_dtype)
    scale = head_dim**-0.5
    tri = cls(heads, kv_heads, head_dim, scale, **kw)
    ref = TorchRefBackend(heads, kv_heads, head_dim, scale)
    tb = make_batch(rows, cache, tri, mode)
    rb = make_batch(rows, cache, ref, mode)
    T = tb.num_tokens
    q = torch.randn(T, heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    out = tri.forward(q, k, v, LAYER, tb)
    # the oracle reads the same cache, upcast: fp32 attention of the stored values
    expect = ref.forward(q.float(), k, v, LAYER, rb)
    n_real = sum(n for _, n in spec)
    got, want = out[:n_real].float(), expect[:n_real]
    assert torch.isfinite(out).all()
    torch.testing.assert_close(got, want, **TOL)
    assert (got - want).abs().mean() < 2e-3, "systematic error"


GEOMETRIES = [(32, 8, 128), (32, 32, 128), (24, 8, 64), (64, 8, 128), (16, 2, 256)]


@pytest.mark.parametrize("heads,kv_heads,head_dim", GEOMETRIES)
@pytest.mark.parametrize("bs,splits", [(1, 8), (7, 16), (64, 8)])
def test_decode_bf16(triton_backend_cls, heads, kv_heads, head_dim, bs, splits):
    gen = torch.Generator().manual_seed(bs)
    lens = torch.randint(1, 4097, (bs,), generator=gen).tolist()
    edges = [1, PS - 1, PS, PS + 1, 4096]
    lens[: min(bs, len(edges))] = edges[: min(bs, len(edges))]
    spec = [(n - 1, 1) for n in lens]
    compare(
        triton_backend_cls,
        spec,
        heads,
        kv_heads,
        head_dim,
        ForwardMode.DECODE,
        pad_rows=3,
        num_kv_splits=splits,
    )


def _rope_inside_and_apart(tri, tb, tb2, cache2, heads, kv_heads, head_dim):
    """(attend_rope on tb: RoPE and the K/V write inside the decode kernel;
    rotary_and_store into cache2 then attend on tb2), on the same random bf16 qkv rows
    (views of one projection, as the model passes them)."""
    from gyrfalcon.kernels.rotary import build_cos_sin_cache, rotary_and_store
    from gyrfalcon.layers.context import LayerContext
    from gyrfalcon.layers.rotary import RotaryEmbedding

    n = tb.positions.shape[0]
    qkv = (torch.randn(n, (heads + 2 * kv_heads) * head_dim, device="cuda") * 4).to(torch.bfloat16)
    split = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    rope = RotaryEmbedding(head_dim, 500000.0, None, 8192, LayerContext()).cuda()
    cos_sin = build_cos_sin_cache(rope.inv_freq, 8192)
    q, k, v = (x.view(n, -1, head_dim) for x in qkv.clone().split(split, dim=-1))
    fused = tri.attend_rope(q, k, v, tb.positions, cos_sin, LAYER, tb)
    q, k, v = (x.view(n, -1, head_dim) for x in qkv.clone().split(split, dim=-1))
    rotary_and_store(
        q, k, v, tb2.positions, cos_sin, cache2.k[LAYER], cache2.v[LAYER], tb2.out_cache_loc
    )
    return fused, tri.attend(q, LAYER, tb2)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])
def test_decode_with_rope_in_the_kernel_equals_rotary_then_attend(
    triton_backend_cls, kv_dtype, heads, kv_heads, head_dim
):
    """What the model runs for decode batches (RoPE and the K/V write inside the decode
    kernel) gives the same bits as rotary_and_store followed by attend: outputs and
    the cache slots written, bf16 and fp8 caches, with padded rows."""
    gen = torch.Generator().manual_seed(4)
    spec = [
        (n - 1, 1) for n in [1, PS, PS + 1] + torch.randint(2, 4097, (20,), generator=gen).tolist()
    ]
    (cache, rows), (cache2, _) = (
        make_case(spec, kv_heads, head_dim, 4, pad_rows=3, kv_dtype=kv_dtype) for _ in range(2)
    )
    cache2.k.copy_(cache.k)
    cache2.v.copy_(cache.v)
    tri = triton_backend_cls(heads, kv_heads, head_dim, head_dim**-0.5)
    tb = make_batch(rows, cache, tri, ForwardMode.DECODE)
    tb2 = make_batch(rows, cache2, tri, ForwardMode.DECODE)
    fused, apart = _rope_inside_and_apart(tri, tb, tb2, cache2, heads, kv_heads, head_dim)
    n = len(spec)
    assert torch.equal(fused[:n], apart[:n])
    slots = tb.out_cache_loc[:n]
    for a, b in ((cache.k, cache2.k), (cache.v, cache2.v)):
        assert torch.equal(a[LAYER][slots].float(), b[LAYER][slots].float())


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])
def test_packed_verify_with_rope_in_the_kernel_equals_rotary_then_attend(
    triton_backend_cls, kv_dtype, heads, kv_heads, head_dim
):
    """Verify rows of k + 1 = 4 tokens packed on the decode kernel with RoPE and the
    K/V writes inside it (what the model runs for them) give the same bits as
    rotary_and_store followed by attend: outputs and the cache slots written."""
    t = 4
    gen = torch.Generator().manual_seed(5)
    spec = [(p, t) for p in [1, PS - 2, PS] + torch.randint(2, 4000, (20,), generator=gen).tolist()]
    (cache, rows), (cache2, _) = (
        make_case(spec, kv_heads, head_dim, 5, kv_dtype=kv_dtype) for _ in range(2)
    )
    cache2.k.copy_(cache.k)
    cache2.v.copy_(cache.v)
    tri = triton_backend_cls(heads, kv_heads, head_dim, head_dim**-0.5)
    # NOTE: rows pack under graphs only: both batches as a graph replays them
    tb = replay_batch(rows, cache, tri, ForwardMode.VERIFY, PS)
    tb2 = replay_batch(rows, cache2, tri, ForwardMode.VERIFY, PS)
    assert tb.attn_meta.packed and tri.fuses_rope(tb)
    fused, apart = _rope_inside_and_apart(tri, tb, tb2, cache2, heads, kv_heads, head_dim)
    assert torch.equal(fused, apart)
    slots = tb.out_cache_loc
    for a, b in ((cache.k, cache2.k), (cache.v, cache2.v)):
        assert torch.equal(a[LAYER][slots].float(), b[LAYER][slots].float())


def test_split_merge_is_deterministic_across_launches(triton_backend_cls):
    """The last program of each (row, KV head) merges the splits that other SMs
    wrote: if it ever read a partial before its writer had stored it, some launch
    would differ. 200 launches (a full grid of 64 x 8 x 16 programs) must give the
    same bits, and every count is back to 0 after them."""
    tri = triton_backend_cls(32, 8, 128, 128**-0.5, num_kv_splits=16)
    gen = torch.Generator().manual_seed(3)
    spec = [(n - 1, 1) for n in torch.randint(64, 4097, (64,), generator=gen).tolist()]
    cache, rows = make_case(spec, 8, 128, seed=3)
    tb = make_batch(rows, cache, tri, ForwardMode.DECODE)
    q = torch.randn(64, 32, 128, device="cuda", dtype=torch.bfloat16)
    first = tri.attend(q, LAYER, tb).clone()
    for _ in range(200):
        assert torch.equal(tri.attend(q, LAYER, tb), first)
    assert not tb.attn_meta.scratch.counts.any()


@pytest.mark.parametrize("heads,kv_heads,head_dim", GEOMETRIES)
def test_extend_mixed_bf16(triton_backend_cls, heads, kv_heads, head_dim):
    # fresh prefills, chunks after long cached prefixes, verify rows, decodes
    spec = [(0, 1024), (3000, 512), (0, 77), (2047, 129), (4000, 96)]
    spec += [(int(p), 4) for p in torch.randint(1, 4000, (16,)).tolist()]
    spec += [(int(p), 1) for p in torch.randint(1, 4000, (8,)).tolist()]
    compare(triton_backend_cls, spec, heads, kv_heads, head_dim, ForwardMode.MIXED)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (9, 3, 64)])
@pytest.mark.parametrize("mode", ["decode", "mixed"])
def test_fp8_kv_cache(triton_backend_cls, heads, kv_heads, head_dim, mode):
    """An e4m3 cache: the kernels read the same stored values as the oracle does."""
    if mode == "decode":
        spec, kw = [(n - 1, 1) for n in (1, 15, 16, 17, 700, 1024, 33)], dict(num_kv_splits=8)
    else:
        spec, kw = [(0, 40), (100, 17), (5, 1), (31, 300)], {}
    m = ForwardMode.DECODE if mode == "decode" else ForwardMode.MIXED
    compare(
        triton_backend_cls, spec, heads, kv_heads, head_dim, m, kv_dtype=torch.float8_e4m3fn, **kw
    )


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_mixed_batch_with_leading_decode_rows(triton_backend_cls, kv_dtype):
    """Decodes first (the decode kernel), then prefill chunks (the extend kernel)."""
    spec = [(n - 1, 1) for n in (1, 17, 1000, 3000)] + [(0, 300), (2000, 512), (7, 1)]
    compare(triton_backend_cls, spec, 32, 8, 128, ForwardMode.MIXED, kv_dtype=kv_dtype)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_verify_bf16(triton_backend_cls, k):
    spec = [(int(p), k + 1) for p in torch.randint(1, 4000, (64,)).tolist()]
    compare(triton_backend_cls, spec, 32, 8, 128, ForwardMode.VERIFY, pad_rows=4)


def test_decode_cuda_graph_replay(triton_backend_cls):
    """Capture a padded decode batch (dummy rows only), replay with real rows."""
    heads, kv_heads, head_dim, padded = 32, 8, 128, 8
    scale = head_dim**-0.5
    tri = triton_backend_cls(heads, kv_heads, head_dim, scale)
    ref = TorchRefBackend(heads, kv_heads, head_dim, scale)
    lens = [1, 300, 4096, 17, 2049]
    cache, rows = make_case([(n - 1, 1) for n in lens], kv_heads, head_dim, 0)
    max_pages = 4096 // PS
    tri.capture_buffers(padded, max_pages, cache.k.device)
    static = {
        "q": torch.zeros(padded, heads, head_dim, device="cuda", dtype=torch.bfloat16),
        "k": torch.zeros(padded, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16),
        "v": torch.zeros(padded, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16),
    }
    # the graph runner's static batch: capture on padding rows only, replay on real ones
    buf = StaticBuffers.allocate(padded, max_pages, PS, cache.k.device)
    key = GraphKey(ForwardMode.DECODE, padded, 1)
    dummy = buf.forward_batch(key, buf.fill(None, key), cache, tri)
    dummy.attn_meta = tri.prepare_replay(dummy)
    run = lambda: tri.forward(static["q"], static["k"], static["v"], LAYER, dummy)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = run()

    buf.fill(build_batch_tensors(rows, PS, cache.k.device), key)  # 5 real rows, 3 padding
    for name in static:
        static[name].normal_()
    graph.replay()
    torch.cuda.synchronize()
    rb = make_batch(rows + [RowInput(0, [0], [0])] * 3, cache, ref, ForwardMode.DECODE)
    expect = ref.forward(static["q"].float(), static["k"], static["v"], LAYER, rb)
    n = len(lens)
    torch.testing.assert_close(static_out[:n].float(), expect[:n], **TOL)
