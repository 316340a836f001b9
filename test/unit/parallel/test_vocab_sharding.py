"""Vocab-parallel embedding and LM head without a process group: which ids each rank
holds (`shard_vocab`, padded when tp does not divide the vocabulary), what its loaders
keep of the full HF tensors (also through a model's loader, tied or not), and that the
ranks' lookups and logits, joined by an in-process communicator, are the single
rank's. At tp 1 nothing changes: the full weight, no collective."""

from datetime import timedelta

import pytest
import torch
import torch.nn.functional as F
from parallel_util import ThreadGroup, load_model, run_ranks

from gyrfalcon.config.sharding import VocabShard, shard_vocab
from gyrfalcon.forward.distributed import init_tensor_parallel
from gyrfalcon.forward.parallel import ParallelContext
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.layers.embedding import LMHead, VocabEmbedding
from gyrfalcon.loader.hf_weights import iter_hf_weights

H = 8
CASES = [(256, 2), (255, 2), (10, 4), (5, 4), (7, 1)]  # (vocab, tp)


@pytest.mark.parametrize("vocab,tp", CASES)
def test_every_id_is_on_exactly_one_rank_in_rank_order(vocab, tp):
    shards = [shard_vocab(vocab, r, tp) for r in range(tp)]
    rows = -(-vocab // tp)
    for r, s in enumerate(shards):
        assert (s.num_rows, s.padded_vocab) == (rows, rows * tp)
        assert 0 <= s.num_ids <= s.num_rows
        if s.num_ids:
            assert s.start == r * rows  # so gathered logits put id i at column i
    held = [i for s in shards for i in range(s.start, s.start + s.num_ids)]
    assert held == list(range(vocab))


def test_padding_sits_after_the_last_id():
    assert shard_vocab(255, 1, 2) == VocabShard(128, 127, 128, 256)
    assert shard_vocab(5, 3, 4) == VocabShard(5, 0, 2, 8)  # a rank holding no id at all
    assert shard_vocab(7, 0, 1) == VocabShard(0, 7, 7, 7)  # tp 1: no padding
    assert ParallelContext(1, 2).vocab(255) == shard_vocab(255, 1, 2)
    with pytest.raises(ValueError, match="tp rank 2 is not in a group of 2"):
        shard_vocab(10, 2, 2)
    with pytest.raises(ValueError, match="vocabulary of 0 ids"):
        shard_vocab(0, 0, 1)


def rank_ctx(rank: int, tp: int, comm=None) -> LayerContext:
    return LayerContext(parallel=ParallelContext(rank, tp, comm))


@pytest.mark.parametrize("vocab,tp", CASES)
def test_each_rank_loads_its_rows_and_zero_padding(vocab, tp):
    full = torch.randn(vocab, H, generator=torch.Generator().manual_seed(0))
    for r in range(tp):
        s = shard_vocab(vocab, r, tp)
        for layer in (
            VocabEmbedding(vocab, H, rank_ctx(r, tp)),
            LMHead(vocab, H, rank_ctx(r, tp)),
        ):
            layer.load("weight", full)
            assert layer.weight.shape == (s.num_rows, H)
            assert torch.equal(layer.weight[: s.num_ids], full[s.start : s.start + s.num_ids])
            assert not layer.weight[s.num_ids :].any()


@pytest.mark.parametrize("vocab,tp", [c for c in CASES if c[1] > 1])
def test_rank_lookups_sum_to_the_full_lookup_exactly(vocab, tp):
    full = torch.randn(vocab, H, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([vocab - 1, *range(vocab), 0])  # every id, out of order too
    group = ThreadGroup(tp)
    layers = []
    for r in range(tp):
        layer = VocabEmbedding(vocab, H, rank_ctx(r, tp, group.member(r)))
        layer.load("weight", full)
        # NOTE: garbage in the padding (a rank with no ids looks its row 0 up) stays out
        layer.weight.data[layer.shard.num_ids :] = float("nan")
        layers.append(layer)
    outs = run_ranks(lambda r: layers[r](ids), tp)
    for out in outs:
        assert torch.equal(out, F.embedding(ids, full))  # one rank adds a row, the rest 0


@pytest.mark.parametrize("vocab,tp", [c for c in CASES if c[1] > 1])
@pytest.mark.parametrize("tied", [False, True])
def test_rank_logits_gather_to_the_full_logits(vocab, tp, tied):
    gen = torch.Generator().manual_seed(2)
    full = torch.randn(vocab, H, generator=gen, dtype=torch.float64)
    hidden = torch.randn(5, H, generator=gen, dtype=torch.float64)
    group = ThreadGroup(tp)
    heads = []
    for r in range(tp):
        ctx = rank_ctx(r, tp, group.member(r))
        embed = VocabEmbedding(vocab, H, ctx).double()
        embed.load("weight", full)
        head = LMHead(vocab, H, ctx, tied=embed if tied else None).double()
        head.load("weight", full if not tied else torch.zeros(1))  # tied: ignored
        heads.append(head)
    outs = run_ranks(lambda r: heads[r](hidden), tp)
    for logits in outs:
        assert logits.shape == (5, vocab) and logits.is_contiguous()
        torch.testing.assert_close(logits, hidden @ full.T, atol=1e-12, rtol=0)


class NoCollectives:
    def all_reduce(self, x):
        raise AssertionError("tp 1 must not all-reduce")

    def all_gather(self, x):
        raise AssertionError("tp 1 must not all-gather")


def test_single_rank_holds_the_full_table_and_calls_no_collective():
    gen = torch.Generator().manual_seed(3)
    full, hidden = torch.randn(11, H, generator=gen), torch.randn(3, H, generator=gen)
    ctx = rank_ctx(0, 1, NoCollectives())
    embed, head = VocabEmbedding(11, H, ctx), LMHead(11, H, ctx)
    embed.load("weight", full)
    head.load("weight", full)
    assert torch.equal(embed.weight, full) and torch.equal(head.weight, full)
    ids = torch.tensor([0, 10, 4])
    assert torch.equal(embed(ids), F.embedding(ids, full))
    assert torch.equal(head(hidden), F.linear(hidden, full))
    x = torch.randn(2, 3)
    assert ctx.parallel.all_gather(x) is x and ctx.parallel.all_reduce(x) is x  # no copy


def test_a_misshapen_vocabulary_tensor_is_a_clear_error():
    with pytest.raises(ValueError, match=r"vocabulary tensor is \[10, 8\], expected \[11, 8\]"):
        VocabEmbedding(11, H, rank_ctx(1, 2)).load("weight", torch.zeros(10, H))
    with pytest.raises(ValueError, match=r"vocabulary tensor is \[1, 8\], expected \[11, 8\]"):
        LMHead(11, H, LayerContext()).load("weight", torch.zeros(1, H))  # no broadcast


@pytest.mark.parametrize("arch", ["llama", "llama-tied"])
def test_a_models_loader_keeps_each_ranks_vocab_rows(tiny_model_dirs, arch):
    """Through LlamaForCausalLM.load_weights: embed_tokens and (untied) lm_head keep
    rank r's half of the vocabulary; a tied head reads the embedding's half."""
    d = tiny_model_dirs[arch]
    hf = dict(iter_hf_weights(d, show_progress=False))
    embed = hf["model.embed_tokens.weight"]
    head = hf.get("lm_head.weight", embed)
    half = embed.shape[0] // 2
    for r in range(2):
        model = load_model(d, rank_ctx(r, 2))
        rows = slice(r * half, (r + 1) * half)
        assert torch.equal(model.embed_tokens.weight, embed[rows])
        if arch == "llama-tied":
            assert model.lm_head.tied is model.embed_tokens
            assert "lm_head.weight" not in dict(model.named_parameters())
        else:
            assert torch.equal(model.lm_head.weight, head[rows])


def test_init_refuses_bad_arguments_before_any_rendezvous():
    cpu, t = torch.device("cpu"), timedelta(seconds=1)
    with pytest.raises(ValueError, match="is not tcp://host:port"):
        init_tensor_parallel(0, 2, 2, "127.0.0.1:29500", cpu, t)
    with pytest.raises(ValueError, match="tp size 2 does not divide the world of 3 ranks"):
        init_tensor_parallel(0, 3, 2, "tcp://127.0.0.1:29500", cpu, t)
    with pytest.raises(ValueError, match="rank 2 is not in a world of 2"):
        init_tensor_parallel(2, 2, 2, "tcp://127.0.0.1:29500", cpu, t)
