"""Cases of the Triton attention backend's interpreter tests (test/unit/layers/
test_triton_attention*.py): ragged paged batches run by the backend and by torch_ref on
the same inputs. Importing it runs the kernels in the interpreter (`triton_interpret`)."""

import torch
import triton_interpret  # noqa: F401  NOTE: first of the gyrfalcon imports
from paged_cases import paged_batch, paged_case, replay_batch

from gyrfalcon.layers.attention.torch_ref import TorchRefBackend
from gyrfalcon.layers.attention.triton_backend import TritonBackend

CPU = torch.device("cpu")
PS = 4  # page size
LAYER = 1  # a non-zero layer, so per-layer cache offsets are exercised
TOL = dict(atol=1e-4, rtol=1e-4)


def make_case(spec, num_kv_heads, head_dim, seed, pad_rows=0, kv_dtype=torch.float32):
    """`paged_case` at this module's page size, on the CPU."""
    return paged_case(spec, num_kv_heads, head_dim, PS, seed, pad_rows, kv_dtype)


def make_batch(rows, cache, backend, mode):
    return paged_batch(rows, cache, backend, mode, PS)


def make_replay_batch(rows, cache, backend, mode):
    return replay_batch(rows, cache, backend, mode, PS)


def run_both(
    spec, heads, kv_heads, head_dim, mode, seed=0, pad_rows=0, kv_dtype=torch.float32,
    replay=False, **kw,
):  # fmt: skip
    """(triton output, torch_ref output, triton batch) on the same inputs; replay: the
    triton batch as a CUDA graph replays it (`make_replay_batch`)."""
    cache, rows = make_case(spec, kv_heads, head_dim, seed, pad_rows, kv_dtype)
    scale = head_dim**-0.5
    tri = TritonBackend(heads, kv_heads, head_dim, scale, **kw)
    ref = TorchRefBackend(heads, kv_heads, head_dim, scale)
    tb = (make_replay_batch if replay else make_batch)(rows, cache, tri, mode)
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


FP8 = torch.float8_e4m3fn
# ragged extend rows: (prefix, new tokens), page edges and one-token rows included
EXTEND_SPEC = [(0, 7), (9, 5), (3, 37), (12, 4), (PS - 1, 4), (5, 1), (0, 1)]
