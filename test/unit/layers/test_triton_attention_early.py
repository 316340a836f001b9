"""The decode kernel's first key block read before its PDL gate (EARLY_KV, chosen by
`attention_launch.early_kv_block`). The rule never picks it on the CPU (no PDL), so
these tests force it on and off and require the same bits from both builds: outputs and
cache writes, for decode and verify rows, RoPE inside the kernel or apart, with the new
tokens' slots holding NaN before the launch (a first block that holds a new token must
be read again after the gate and the kernel's own writes, never from before them)."""

import pytest
import torch
from triton_attention_cases import FP8, LAYER, PS, make_batch, make_case, make_replay_batch

from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.kernels import attention_launch
from gyrfalcon.kernels.attention_launch import EARLY_KV_MAX_HEAD_DIM, early_kv_block
from gyrfalcon.kernels.rotary import build_cos_sin_cache
from gyrfalcon.layers.attention.triton_backend import TritonBackend
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.layers.rotary import RotaryEmbedding


def _run(monkeypatch, early, spec, heads, kv_heads, mode, rope, replay, kv_dtype, **kw):
    """(output, the new tokens' cached K, V) of one Triton backend run with EARLY_KV
    forced to `early`, on a fresh case whose new slots hold NaN."""
    monkeypatch.setattr(attention_launch, "early_kv_block", lambda *a: early)
    head_dim = 64
    cache, rows = make_case(spec, kv_heads, head_dim, 5, kv_dtype=kv_dtype)
    tri = TritonBackend(heads, kv_heads, head_dim, head_dim**-0.5, **kw)
    tb = (make_replay_batch if replay else make_batch)(rows, cache, tri, mode)
    slots = tb.out_cache_loc
    cache.k[LAYER][slots] = float("nan")
    cache.v[LAYER][slots] = float("nan")
    gen = torch.Generator().manual_seed(6)
    n = slots.shape[0]
    q, k, v = (torch.randn(n, h, head_dim, generator=gen) for h in (heads,) + 2 * (kv_heads,))
    if rope:
        assert tri.fuses_rope(tb)
        inv_freq = RotaryEmbedding(head_dim, 10000.0, None, 128, LayerContext()).inv_freq
        out = tri.attend_rope(q, k, v, tb.positions, build_cos_sin_cache(inv_freq, 128), LAYER, tb)
    else:
        out = tri.forward(q, k, v, LAYER, tb)
    assert not tb.attn_meta.scratch.counts.any()
    return out, cache.k[LAYER][slots].float(), cache.v[LAYER][slots].float()


CASES = {
    # decode rows across page and block edges (16 keys a block), RoPE and the K/V write
    # inside the kernel; the first rows' only block holds the new token
    "decode-rope": ([(n - 1, 1) for n in (1, PS, PS + 1, 17, 29, 61)], ForwardMode.DECODE, True, False),
    # RoPE apart: the new K/V were written by the store kernel before the launch
    "decode": ([(n - 1, 1) for n in (1, PS + 1, 33, 61)], ForwardMode.DECODE, False, False),
    # packed verify rows of k + 1 = 4 tokens as graphs replay them (RoPE inside)
    "verify-packed": ([(p, 4) for p in (1, PS - 2, 2 * PS + 1, 29, 44)], ForwardMode.VERIFY, True, True),
    # eager verify rows: one program row per token, RoPE apart
    "verify-per-token": ([(p, 4) for p in (1, 2 * PS + 1, 44)], ForwardMode.VERIFY, False, False),
}  # fmt: skip


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("kv_dtype", [torch.float32, FP8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_early_first_block_changes_no_bit(monkeypatch, case, kv_dtype, splits):
    spec, mode, rope, replay = CASES[case]
    kw = dict(num_kv_splits=splits, decode_block_n=16)
    late = _run(monkeypatch, False, spec, 6, 2, mode, rope, replay, kv_dtype, **kw)
    early = _run(monkeypatch, True, spec, 6, 2, mode, rope, replay, kv_dtype, **kw)
    for a, b in zip(late, early, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=False)


def test_early_kv_rule():
    """Early only with PDL, a 16-bit cache, heads up to 64 wide, rows not packed and a
    grid of at most one program per SM: SmolLM2 at batch 1 (3 KV heads x 16 splits on
    132 SMs), not at 16, nor the 8B's 128-wide heads, nor an fp8 cache, nor packed
    verify rows."""
    assert early_kv_block(48, 132, 64, False, True, False)
    assert early_kv_block(132, 132, EARLY_KV_MAX_HEAD_DIM, False, True, False)
    assert not early_kv_block(133, 132, 64, False, True, False)
    assert not early_kv_block(48, 132, 64, False, False, False)
    assert not early_kv_block(48, 132, 64, True, True, False)
    assert not early_kv_block(128, 132, 128, False, True, False)
    assert not early_kv_block(48, 132, 64, False, True, True)
