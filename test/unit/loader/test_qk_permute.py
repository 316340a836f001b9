"""Tests for the llama.cpp q/k row permutation and its inverse."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.loader.gguf_convert import permute_qk, unpermute_qk


def _rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF rope on one head vector: dimension i pairs with i + d/2."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """llama.cpp (GPT-J style) rope on one head vector: dimension 2i pairs with 2i + 1."""
    even, odd = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out


@pytest.mark.parametrize("n_head,head_dim,cols", [(1, 2, 3), (3, 8, 5), (9, 64, 7), (2, 6, 1)])
def test_permute_matches_llamacpp_reference(
    n_head: int, head_dim: int, cols: int, reference_permute
) -> None:
    w = torch.randn(n_head * head_dim, cols)
    expected = torch.from_numpy(reference_permute(w.numpy(), n_head))
    assert torch.equal(permute_qk(w, n_head), expected)


@pytest.mark.parametrize("n_head,head_dim,cols", [(3, 8, 5), (9, 64, 7), (2, 6, 4)])
def test_round_trip(n_head: int, head_dim: int, cols: int) -> None:
    w = torch.randn(n_head * head_dim, cols)
    assert torch.equal(unpermute_qk(permute_qk(w, n_head), n_head), w)
    assert torch.equal(permute_qk(unpermute_qk(w, n_head), n_head), w)
    # the permutation is not the identity, so the test above is meaningful
    assert not torch.equal(permute_qk(w, n_head), w)


def test_unpermute_inverts_llamacpp_reference_on_bias(reference_permute) -> None:
    bias = torch.arange(24, dtype=torch.float32)
    gguf_bias = torch.from_numpy(reference_permute(bias.numpy(), 3))
    assert torch.equal(unpermute_qk(gguf_bias, 3), bias)


def test_gguf_rows_are_interleaved_rope_pairs() -> None:
    n_head, head_dim = 3, 8
    half = head_dim // 2
    hf = torch.arange(n_head * head_dim, dtype=torch.float32)[:, None].repeat(1, 2)
    gguf = permute_qk(hf, n_head)
    for h in range(n_head):
        base = h * head_dim
        assert gguf[base, 0] == base and gguf[base + 1, 0] == base + half
        for i in range(half):
            assert gguf[base + 2 * i, 0] == base + i
            assert gguf[base + 2 * i + 1, 0] == base + i + half


def test_interleaved_rope_on_gguf_layout_equals_rotate_half_on_hf_layout(
    reference_permute,
) -> None:
    n_head, head_dim, hidden = 2, 8, 5
    torch.manual_seed(0)
    w_hf = torch.randn(n_head * head_dim, hidden)
    w_gguf = torch.from_numpy(reference_permute(w_hf.numpy(), n_head))
    x = torch.randn(hidden)
    angles = torch.rand(head_dim // 2) * 3.0
    cos, sin = angles.cos(), angles.sin()
    q_hf = _rope_rotate_half((w_hf @ x).view(n_head, head_dim), cos, sin)
    q_gguf = _rope_interleaved((w_gguf @ x).view(n_head, head_dim), cos, sin)
    # rope commutes with the permutation: same rotated values, just reordered
    assert torch.allclose(permute_qk(q_hf.reshape(-1), n_head), q_gguf.reshape(-1), atol=1e-6)
    q_back = _rope_rotate_half((unpermute_qk(w_gguf, n_head) @ x).view(n_head, head_dim), cos, sin)
    assert torch.allclose(q_back, q_hf, atol=1e-6)


@pytest.mark.parametrize("fn", [permute_qk, unpermute_qk])
def test_bad_shapes_raise(fn) -> None:
    with pytest.raises(ValueError):
        fn(torch.zeros(10, 4), 3)  # 10 rows do not split into 3 heads
    with pytest.raises(ValueError):
        fn(torch.zeros(9, 4), 3)  # odd head_dim has no rope pairs
