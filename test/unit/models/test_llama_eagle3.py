"""The EAGLE3 drafter: SGLang/vLLM checkpoints load strictly and round-trip; its forward
over a paged KV cache (torch_ref) equals a dense reference written here, for an extend,
a decode step reading the cached KV and an extend after a cached prefix; the
vocabulary maps."""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import make_tiny_eagle3
from eagle3_util import run_draft_round

from gyrfalcon.config.draft_config import DraftConfig
from gyrfalcon.layers.attention.torch_ref import TorchRefBackend
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.loader.hf_weights import iter_hf_weights
from gyrfalcon.models.llama_eagle3 import LlamaForCausalLMEagle3
from gyrfalcon.models.registry import build_draft_model

CPU = torch.device("cpu")
PAGE = 4
TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-eagle3"))
    make_tiny_eagle3(path)
    return path


@pytest.fixture
def target(llama8_dir, load_llama):
    return load_llama(llama8_dir, LayerContext())


def load_drafter(target, path: str, load_format: str = "auto") -> LlamaForCausalLMEagle3:
    cfg = DraftConfig.from_dir(path)
    ctx, emb = LayerContext(), target.embed_tokens
    return build_draft_model(
        cfg, target.cfg, path, torch.float32, CPU, ctx, emb, load_format, show_progress=False
    )


def file_tensors(path: str) -> dict[str, torch.Tensor]:
    return dict(iter_hf_weights(path, show_progress=False))


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name


def test_loads_strictly_and_shares_the_targets_embedding(target, draft_dir):
    drafter = load_drafter(target, draft_dir)
    assert drafter.embed_tokens is target.embed_tokens
    assert_same_tensors(drafter.hf_state_dict(), file_tensors(draft_dir))
    assert drafter.aux_layer_ids(target.cfg.num_layers) == (2, 4, 5)


def test_a_checkpoints_own_embedding_is_ignored(target, tmp_path):
    path = str(tmp_path / "with-embed")
    tensors = make_tiny_eagle3(path, embed_tokens=True)
    before = target.embed_tokens.weight.clone()
    drafter = load_drafter(target, path)
    assert torch.equal(target.embed_tokens.weight, before)
    del tensors["embed_tokens.weight"]
    assert_same_tensors(drafter.hf_state_dict(), tensors)


def test_load_weights_names_what_is_missing_or_unknown(target, draft_dir):
    cfg = DraftConfig.from_dir(draft_dir)
    tensors = file_tensors(draft_dir)
    drafter = LlamaForCausalLMEagle3(cfg, LayerContext(), target.embed_tokens)
    partial = {n: t for n, t in tensors.items() if n != "midlayer.hidden_norm.weight"}
    with pytest.raises(ValueError, match="midlayer.hidden_norm.weight"):
        drafter.load_weights(partial.items())
    with pytest.raises(ValueError, match="'midlayer.mlp.gate_proj.bias' has no place"):
        drafter.load_weights([*tensors.items(), ("midlayer.mlp.gate_proj.bias", torch.zeros(96))])
    with pytest.raises(ValueError, match="no d2t"):
        drafter.load_weights((n, t) for n, t in tensors.items() if n != "d2t")
    d2t = tensors["d2t"].clone()
    d2t[0] = int((~tensors["t2d"]).nonzero()[0])  # draft id 0 -> a target id t2d lacks
    with pytest.raises(ValueError, match="t2d"):
        drafter.load_weights(dict(tensors, d2t=d2t).items())


def test_save_pretrained_round_trips(target, draft_dir, tmp_path):
    drafter = load_drafter(target, draft_dir)
    out = str(tmp_path / "saved")
    drafter.save_pretrained(out)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert_same_tensors(file_tensors(out), file_tensors(draft_dir))
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLMEagle3"]
    assert DraftConfig.from_dir(out) == drafter.cfg
    again = load_drafter(target, out)
    assert_same_tensors(again.hf_state_dict(), drafter.hf_state_dict())


def test_vocabulary_maps(target, draft_dir):
    drafter = load_drafter(target, draft_dir)
    d2t = file_tensors(draft_dir)["d2t"]
    draft_ids = torch.tensor([[0, 5], [31, 17]])
    assert torch.equal(drafter.to_target_ids(draft_ids), draft_ids + d2t[draft_ids])
    hot = torch.arange(32) + d2t
    assert torch.equal(drafter.target_to_draft(hot), torch.arange(32))
    assert torch.equal(drafter.t2d, file_tensors(draft_dir)["t2d"])
    cold = (~drafter.t2d).nonzero().flatten()
    assert (drafter.target_to_draft(cold) == -1).all()
    q = torch.softmax(torch.randn(3, 32), dim=-1)
    q_target = drafter.draft_probs_to_target(q)  # [3, vocab]
    assert torch.equal(q_target[:, hot], q) and (q_target[:, cold] == 0).all()
    torch.testing.assert_close(q_target.sum(-1), torch.ones(3))


def test_a_dummy_drafter_keeps_the_targets_embedding(target, draft_dir):
    before = target.embed_tokens.weight.clone()
    drafter = load_drafter(target, draft_dir, load_format="dummy")
    assert torch.equal(target.embed_tokens.weight, before)
    assert torch.equal(drafter.to_target_ids(torch.arange(32)), torch.arange(32))
    assert (drafter.midlayer.hidden_norm.weight == 1).all()


# --- the forward against a dense reference ---------------------------------------------


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    # x: [T, heads, d], rotate-half layout
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angle = pos.float()[:, None] * inv_freq[None, :]  # [T, d/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def dense_drafter(w: dict[str, torch.Tensor], cfg: DraftConfig, embeds, hidden) -> torch.Tensor:
    """One sequence at positions 0..T-1, all at once, no cache: [T, H] pre-norm outputs."""
    lyr, eps = cfg.layer, cfg.layer.rms_norm_eps
    T, nh, nkv, hd = embeds.shape[0], lyr.num_heads, lyr.num_kv_heads, lyr.head_dim
    a, m = "midlayer.self_attn", "midlayer.mlp"
    x = torch.cat(
        [
            rms(embeds, w["midlayer.input_layernorm.weight"], eps),
            rms(hidden, w["midlayer.hidden_norm.weight"], eps),
        ],
        dim=-1,
    )
    pos = torch.arange(T)
    q = rope((x @ w[f"{a}.q_proj.weight"].T).view(T, nh, hd), pos, lyr.rope_theta)
    k = rope((x @ w[f"{a}.k_proj.weight"].T).view(T, nkv, hd), pos, lyr.rope_theta)
    v = (x @ w[f"{a}.v_proj.weight"].T).view(T, nkv, hd)
    k, v = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / hd**0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(T, nh * hd)
    h = hidden + attn @ w[f"{a}.o_proj.weight"].T
    n = rms(h, w["midlayer.post_attention_layernorm.weight"], eps)
    gate, up = n @ w[f"{m}.gate_proj.weight"].T, n @ w[f"{m}.up_proj.weight"].T
    return h + (F.silu(gate) * up) @ w[f"{m}.down_proj.weight"].T


def test_forward_on_a_paged_cache_equals_a_dense_reference(target, draft_dir):
    """Two ragged rows: DRAFT_EXTEND of 7 and 5 tokens, one DRAFT_DECODE step fed each
    row's last output, then a DRAFT_EXTEND of 3 after that cached prefix, pages
    interleaved between the rows (`run_draft_round`). Every output equals the dense
    reference over the row's whole sequence, in position order."""
    drafter = load_drafter(target, draft_dir)
    cfg, w = drafter.cfg, file_tensors(draft_dir)
    lyr = cfg.layer
    backend = TorchRefBackend(lyr.num_heads, lyr.num_kv_heads, lyr.head_dim, lyr.head_dim**-0.5)
    run = run_draft_round(drafter, backend, PAGE)
    aux = torch.randn(5, 3 * cfg.target_hidden_size)
    torch.testing.assert_close(drafter.fuse(aux), aux @ w["fc.weight"].T)
    for ids, hidden, outs in zip(run.ids, run.hidden, run.outs):
        embeds = F.embedding(ids, target.embed_tokens.weight)
        torch.testing.assert_close(outs, dense_drafter(w, cfg, embeds, hidden), **TOL)
    logits = drafter.compute_logits(run.outs[0])
    want_logits = rms(run.outs[0], w["norm.weight"], lyr.rms_norm_eps) @ w["lm_head.weight"].T
    assert logits.shape == (run.outs[0].shape[0], cfg.draft_vocab_size)
    torch.testing.assert_close(logits, want_logits, **TOL)
