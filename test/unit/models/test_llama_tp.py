"""Tensor parallelism through the layer context, without process groups: tp ranks of a
tiny Llama run in tp threads of one process, their row-parallel layers and
vocab-parallel embedding all-reducing, their LM heads all-gathering, through an
in-process communicator. Together they give the single rank's output."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_hf_model
from parallel_util import ThreadGroup, run_ranks

from gyrfalcon.forward.parallel import ParallelContext
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.loader.hf_weights import iter_hf_weights

# NOTE: ids < 250 (the odd vocabulary), the shard edges of tp 4 over 250 ids among them
PROMPTS = [[5, 17, 33, 2, 249, 9, 9, 41, 7, 100, 3], [8, 1, 200, 45, 6, 62, 63, 189, 0]]


@pytest.fixture(scope="module")
def tied_odd_vocab_dir(tmp_path_factory) -> str:
    """llama8's heads with a tied LM head over 250 ids: tp 4 pads each rank to 63 rows
    (the last holds 61 ids)."""
    path = str(tmp_path_factory.mktemp("tiny-llama8-tied-250"))
    make_tiny_hf_model(path, "llama-tied", num_attention_heads=8, vocab_size=250)
    return path


@pytest.mark.parametrize("tp", [2, 4])  # tp 2 splits the 2 KV heads; tp 4 replicates them
@pytest.mark.parametrize("checkpoint", ["llama8", "tied-odd-vocab"])
def test_tp_ranks_together_equal_one_rank(request, load_llama, prefill_batch, checkpoint, tp):
    fixture = {"llama8": "llama8_dir", "tied-odd-vocab": "tied_odd_vocab_dir"}[checkpoint]
    model_dir = request.getfixturevalue(fixture)
    one = LayerContext()
    single = load_llama(model_dir, one)
    with torch.inference_mode():
        want = single(prefill_batch(single, PROMPTS, one))  # [T, hidden]
        want_logits = single.compute_logits(want)
    group = ThreadGroup(tp)
    ctxs = [LayerContext(parallel=ParallelContext(r, tp, group.member(r))) for r in range(tp)]
    models = [load_llama(model_dir, ctx) for ctx in ctxs]
    batches = [prefill_batch(m, PROMPTS, ctx) for m, ctx in zip(models, ctxs)]
    cfg = single.cfg
    for m, b in zip(models, batches):
        attn = m.layers[0].self_attn
        assert attn.num_heads == cfg.num_heads // tp
        assert attn.num_kv_heads == b.kv_cache.k.shape[2] == max(1, cfg.num_kv_heads // tp)

    def rank(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = models[r](batches[r])
        return hidden, models[r].compute_logits(hidden)

    outs = run_ranks(rank, tp)
    for hidden, logits in outs:
        assert torch.equal(hidden, outs[0][0])  # every rank holds the same reduced stream
        assert torch.equal(logits, outs[0][1])  # and all the vocabulary's logits
    # NOTE: the reduce sums the heads' and the MLP's partial products in another order
    torch.testing.assert_close(outs[0][0], want, atol=1e-5, rtol=1e-5)
    assert outs[0][1].shape == want_logits.shape and outs[0][1].is_contiguous()
    torch.testing.assert_close(outs[0][1], want_logits, atol=1e-4, rtol=0)


def test_each_rank_loads_its_heads_of_the_checkpoint(llama8_dir, load_llama):
    """tp 4 over 8 query and 2 KV heads: rank r holds query heads 2r, 2r+1 and KV head
    r // 2 (replicated on two ranks); o_proj its heads' columns; MLP a quarter."""
    hf = dict(iter_hf_weights(llama8_dir, show_progress=False))
    q, k, v = (hf[f"model.layers.3.self_attn.{p}_proj.weight"] for p in "qkv")
    o = hf["model.layers.3.self_attn.o_proj.weight"]
    gate, up = (hf[f"model.layers.3.mlp.{p}_proj.weight"] for p in ("gate", "up"))
    down = hf["model.layers.3.mlp.down_proj.weight"]
    d, inter = q.shape[0] // 8, gate.shape[0] // 4
    for r in range(4):
        layer = load_llama(llama8_dir, LayerContext(parallel=ParallelContext(r, 4))).layers[3]
        qs, kvs = slice(2 * r * d, (2 * r + 2) * d), slice(r // 2 * d, (r // 2 + 1) * d)
        assert torch.equal(layer.self_attn.qkv_proj.weight, torch.cat([q[qs], k[kvs], v[kvs]]))
        assert torch.equal(layer.self_attn.o_proj.weight, o[:, qs])
        rows = slice(r * inter, (r + 1) * inter)
        assert torch.equal(layer.mlp.gate_up_proj.weight, torch.cat([gate[rows], up[rows]]))
        assert torch.equal(layer.mlp.down_proj.weight, down[:, rows])


class FusingMember:
    """A thread rank's communicator that also sums, adds and normalizes in one call
    (as the one-shot kernel does on GPUs), in torch: the sum as `all_reduce` gives it,
    then RMSNorm's reference math, in place. Counts its fused calls."""

    def __init__(self, member):
        self.member, self.fused = member, 0
        self.equal_rows = False
        self.keep_counts = False

    def all_reduce(self, x):
        return self.member.all_reduce(x)

    def all_gather(self, x):
        return self.member.all_gather(x)

    def all_gather_rows(self, x):
        return self.member.all_gather_rows(x)

    def reduce_scatter(self, x):
        return self.member.reduce_scatter(x)

    def all_reduce_add_rmsnorm(self, x, residual, weight, eps):
        self.fused += 1
        h = self.all_reduce(x) + residual
        hf = h.float()
        normed = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
        residual.copy_(h)
        return x.copy_(normed), residual


def test_sums_fused_into_the_next_add_and_norm_give_the_same_bits(
    llama8_dir, load_llama, prefill_batch
):
    """Over TP the layers leave their output sums to the add+norm after them: with a
    communicator that fuses sum + add + norm, every such norm takes the fused call
    (2 per layer: post-attention, next input or final; none where an EAGLE3 aux state
    is captured, which needs the summed stream) and the hidden states, logits and aux
    states are the same bits as with sums in the layers."""
    tp = 2
    outs = {}
    for name, wrap in (("plain", lambda m: m), ("fusing", FusingMember)):
        group = ThreadGroup(tp)
        comms = [wrap(group.member(r)) for r in range(tp)]
        ctxs = [LayerContext(parallel=ParallelContext(r, tp, comms[r])) for r in range(tp)]
        models = [load_llama(llama8_dir, ctx) for ctx in ctxs]
        batches = [prefill_batch(m, PROMPTS, ctx) for m, ctx in zip(models, ctxs)]
        layers = len(models[0].layers)
        aux = (1, layers - 1)

        def rank(r: int, models=models, batches=batches, aux=aux):
            hidden, captured = models[r].forward_aux(batches[r], aux)
            return hidden, models[r].compute_logits(hidden), captured

        outs[name] = run_ranks(rank, tp)
        if name == "fusing":
            # aux at layer i: the sum entering layer i is done alone (layers 1 and L - 1)
            assert [c.fused for c in comms] == [2 * layers - len(aux)] * tp
    for (h, logits, cap), (h2, logits2, cap2) in zip(outs["plain"], outs["fusing"]):
        assert torch.equal(h, h2) and torch.equal(logits, logits2)
        assert all(torch.equal(a, b) for a, b in zip(cap, cap2))
