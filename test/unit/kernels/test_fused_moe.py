"""The fused MoE kernels (run in the CPU interpreter) against `moe_reference`, and their
index math: the shape-only block bound and the sorted, padded block layout."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: must precede every triton import

import math  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402

from gyrfalcon.kernels.fused_moe import (  # noqa: E402
    MoeConfig,
    fused_moe,
    moe_config,
    warm_up_token_counts,
)
from gyrfalcon.kernels.moe_align import (  # noqa: E402
    ALIGN_TILE_ELEMS,
    align_tile,
    max_blocks,
    moe_align,
)
from gyrfalcon.layers.moe import moe_reference  # noqa: E402

H, INTER = 48, 40  # neither a multiple of the 32-wide test blocks: N and K tails
# 16-row blocks, 32-wide N and K tiles: two K steps over H, and over I
SMALL = MoeConfig(block_m=16, block_n=32, block_k=32, num_warps=4, num_stages=1)
# NOTE: triton's interpreter truncates float32 -> bfloat16 where the GPU rounds to
# nearest even, and the expert math rounds four times (gate_up, silu, product, down),
# so bf16 checks here allow a few bf16 ulps (2**-7 relative each).
BF16_REL = 2**-5


def experts(num_experts, dtype=torch.float32, seed=0):
    """(w13 [E, 2I, H], w2 [E, H, I]) scaled so that expert outputs are O(1)."""
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * INTER, H, generator=gen) * 0.3 / math.sqrt(H)
    w2 = torch.randn(num_experts, H, INTER, generator=gen) * 1.2 / math.sqrt(INTER)
    return w13.to(dtype), w2.to(dtype)


def routing(num_tokens, top_k, num_experts, seed=0, invalid=True, w_dtype=torch.float32):
    """Random ids [T, k] (distinct per token, as top-k gives) with some slots set to -1
    and E + 1 (skipped), and weights [T, k] in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]
    if invalid and num_tokens > 1:
        ids[0, -1] = -1
        ids[num_tokens // 2, 0] = num_experts + 1
    weights = torch.rand(num_tokens, top_k, generator=gen).to(w_dtype)
    return weights, ids


def tokens(num_tokens, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randn(num_tokens, H, generator=gen).to(dtype)


def check(x, w13, w2, weights, ids, config=SMALL):
    out = fused_moe(x, w13, w2, weights, ids, config=config)
    want = moe_reference(x, w13, w2, weights, ids)
    assert out.shape == want.shape and out.dtype == want.dtype == x.dtype
    if x.dtype == torch.float32:
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    else:
        err = (out.float() - want.float()).abs()
        assert (err <= BF16_REL * want.float().abs().clamp_min(1.0)).all(), err.max()
    return out


# --- index math ---------------------------------------------------------------------


@pytest.mark.parametrize("block_m", [1, 16, 64])
@pytest.mark.parametrize("num_experts", [1, 4, 128])
def test_max_blocks_bounds_every_routing_and_is_attained(block_m, num_experts):
    # sum_e ceil(c_e / BM) <= (P + min(E, P)(BM - 1)) // BM for all counts summing to <= P
    gen = torch.Generator().manual_seed(block_m * num_experts)
    for num_pairs in (0, 1, 7, 16, 100, 1000):
        bound = max_blocks(num_pairs, num_experts, block_m)
        for _ in range(20):
            ids = torch.randint(0, num_experts + 1, (num_pairs,), generator=gen)  # E: skipped
            counts = torch.bincount(ids, minlength=num_experts + 1)[:num_experts]
            assert sum(-(-c // block_m) for c in counts.tolist()) <= bound
        # attained: min(E, P) experts each with one more than a multiple of BM, or P
        busy = min(num_experts, num_pairs)
        if busy:
            per, extra = divmod(num_pairs, busy)
            counts = [per + (e < extra) for e in range(busy)]
            assert sum(-(-c // block_m) for c in counts) <= bound
    assert max_blocks(8, 128, 16) == 8  # decode: one block per routed expert
    assert max_blocks(4096, 8, 64) == 64 + 7
    assert max_blocks(0, 8, 16) == 0


def test_align_tile_and_config():
    for e in (1, 4, 8, 60, 128, 256):
        e_pad, rows = align_tile(e)
        assert e_pad >= e and e_pad & (e_pad - 1) == 0 and rows >= 16
        assert rows * e_pad <= max(ALIGN_TILE_ELEMS, 16 * e_pad)
    decode, prefill = moe_config(8, 128), moe_config(8192 * 8, 128)
    assert decode.block_m == 16 and prefill.block_m == 128
    assert [moe_config(t * 8, 128).block_m for t in (256, 512, 1024, 4096)] == [16, 32, 64, 128]
    with pytest.raises(AssertionError):
        MoeConfig(block_m=8, block_n=32, block_k=32, num_warps=4, num_stages=1)


@pytest.mark.parametrize(
    "num_experts,top_k,routed",
    [(64, 8, 64), (128, 8, 128), (8, 2, 8), (4, 2, 4), (1, 1, 1), (16, 4, 16), (32, 8, 32)]
    + [(32, 8, 128), (16, 8, 128), (4, 2, 8), (1, 1, 8)],  # EP: a rank's share of `routed`
)
@pytest.mark.parametrize("max_tokens", [1, 7, 100, 3000])
def test_warm_up_token_counts_meet_every_kernel_variant(num_experts, top_k, routed, max_tokens):
    """The few token counts of the warm-up build what any batch of up to max_tokens
    tokens would: the same (config, one chunk or several) variants, so no Triton
    kernel is built while serving an eager step (a prefill, a DP gather)."""

    def variant(t: int) -> tuple[MoeConfig, bool]:
        one_chunk = t * top_k <= align_tile(num_experts)[1]
        return moe_config(t * top_k, routed), one_chunk

    counts = warm_up_token_counts(num_experts, top_k, max_tokens, routed)
    assert counts and max(counts) <= max_tokens and len(counts) <= 9
    want = {variant(t) for t in range(1, max_tokens + 1)}
    assert {variant(t) for t in counts} == want


# one chunk of pairs (one program), and several (E >= 100: chunks of 64 pairs)
@pytest.mark.parametrize(
    "num_pairs,num_experts,block_m",
    [(1, 8, 16), (37, 4, 16), (300, 3, 16), (90, 8, 32), (300, 128, 16), (130, 100, 32)],
)
def test_align_sorts_pads_and_marks_dead_blocks(num_pairs, num_experts, block_m):
    assert (num_pairs > align_tile(num_experts)[1]) == (num_experts >= 100)
    gen = torch.Generator().manual_seed(num_pairs)
    ids = torch.randint(-1, num_experts + 2, (num_pairs, 1), generator=gen)  # some skipped
    lay = moe_align(ids.reshape(-1), num_experts, block_m, pdl=False)
    blocks = max_blocks(num_pairs, num_experts, block_m)
    assert lay.block_expert.shape == (blocks,) and lay.sorted_pair.shape == (blocks * block_m,)
    flat = ids.reshape(-1)
    counts = [int((flat == e).sum()) for e in range(num_experts)]
    live = sum(-(-c // block_m) for c in counts)
    be = lay.block_expert.tolist()
    assert be[:live] == sorted(be[:live]) and all(e < num_experts for e in be[:live])
    assert all(e >= num_experts for e in be[live:])  # dead: their programs exit at once
    rows = lay.sorted_pair[: live * block_m].view(live, block_m)
    for e, c in enumerate(counts):
        mine = rows[torch.tensor(be[:live]) == e].reshape(-1)
        assert mine.numel() == -(-c // block_m) * block_m
        # the expert's pairs in increasing order, then the sentinel P as padding
        want = (flat == e).nonzero().reshape(-1).to(torch.int32)
        assert torch.equal(mine[:c], want) and (mine[c:] == num_pairs).all()


# --- the kernels against the reference ----------------------------------------------


@pytest.mark.parametrize("num_experts", [4, 8])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("num_tokens", [0, 1, 5, 19])
def test_matches_reference_float32(num_tokens, top_k, num_experts):
    w13, w2 = experts(num_experts)
    weights, ids = routing(num_tokens, top_k, num_experts, seed=num_tokens)
    out = check(tokens(num_tokens), w13, w2, weights, ids)
    if num_tokens > 1 and top_k == 1:
        assert (out[0] == 0).all()  # its only slot is skipped


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("w_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 2), (23, 2)])
def test_matches_reference_bf16(num_tokens, top_k, w_dtype, ids_dtype):
    w13, w2 = experts(8, torch.bfloat16)
    weights, ids = routing(num_tokens, top_k, 8, seed=3, w_dtype=w_dtype)
    check(tokens(num_tokens, torch.bfloat16), w13, w2, weights, ids.to(ids_dtype))


def test_many_chunks_of_pairs():
    # 19 x 8 pairs over chunks of 128 pairs (E 64): the three-kernel align
    w13, w2 = experts(64)
    weights, ids = routing(19, 8, 64, seed=7)
    assert 19 * 8 > align_tile(64)[1]
    check(tokens(19), w13, w2, weights, ids)


def test_default_config_and_strided_rows():
    w13, w2 = experts(8, torch.bfloat16)
    weights, ids = routing(9, 2, 8, seed=5, w_dtype=torch.bfloat16)
    wide = tokens(9, torch.bfloat16).repeat(1, 2)  # rows of stride 2 H
    check(wide[:, :H], w13, w2, weights, ids, config=None)


def test_one_ranks_share_of_the_experts_under_ep_with_blocks_for_its_rows():
    """EP: 4 local experts of 16 (ids of the others' skipped); the default config is
    picked from the rows each local expert gets (T k / 16 -> 16-row blocks), not from
    T k / 4 (64-row blocks), and the sum is still the reference's."""
    w13, w2 = experts(4)
    weights, global_ids = routing(32, 8, 16, seed=3, invalid=False)
    ids = global_ids.masked_fill(global_ids >= 4, -1)  # rank 0 owns experts 0..3
    assert moe_config(32 * 8, 16).block_m == 16 and moe_config(32 * 8, 4).block_m == 64
    out = fused_moe(tokens(32), w13, w2, weights, ids, routed_experts=16)
    torch.testing.assert_close(
        out, moe_reference(tokens(32), w13, w2, weights, ids), atol=1e-5, rtol=1e-5
    )


def test_every_token_on_one_expert_and_idle_experts():
    # 40 pairs on expert 2 fill three 16-row blocks (the last padded); 0, 1, 3 get none
    w13, w2 = experts(4)
    check(tokens(40), w13, w2, torch.rand(40, 1), torch.full((40, 1), 2))
    skipped = torch.tensor([-1, 9] * 10)  # each token's second slot names no local expert
    ids = torch.stack([torch.full((20,), 2), skipped], dim=1)
    check(tokens(20), w13, w2, torch.rand(20, 2), ids)


def test_all_slots_skipped_gives_zeros():
    w13, w2 = experts(4)
    ids = torch.tensor([[-1, 4], [7, -3]])
    out = check(tokens(2), w13, w2, torch.rand(2, 2), ids)
    assert (out == 0).all()


def test_static_shapes_new_ids_and_no_host_sync(monkeypatch):
    # as a replayed CUDA graph would: the same shapes, other ids written in place; and
    # nothing reads a device value back to the host during the call
    w13, w2 = experts(8)
    x, weights, ids = tokens(12), torch.empty(12, 2), torch.empty(12, 2, dtype=torch.int64)
    runs = [routing(12, 2, 8, seed=s) for s in (0, 1)]
    runs.append((torch.rand(12, 2), torch.full((12, 2), 5)))  # all on one expert
    wants = [moe_reference(x, w13, w2, w, i) for w, i in runs]

    def no_sync(*args, **kwargs):
        raise AssertionError("host sync during fused_moe")

    for name in ("item", "tolist", "nonzero", "unique", "__bool__", "cpu", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    for name in ("nonzero", "unique", "bincount", "masked_select"):
        monkeypatch.setattr(torch, name, no_sync)
    outs = []
    for w, i in runs:
        weights.copy_(w)
        ids.copy_(i)
        outs.append(fused_moe(x, w13, w2, weights, ids, config=SMALL))
    monkeypatch.undo()
    for out, want in zip(outs, wants):
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
