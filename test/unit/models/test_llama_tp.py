"""Tensor parallelism through the layer context, without process groups: tp ranks of a
tiny Llama run in tp threads of one process, their row-parallel layers all-reducing
through an in-process communicator. Together they give the single rank's output."""

from __future__ import annotations

import threading

import pytest
import torch

from gyrfalcon.forward.parallel import ParallelContext
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.loader.hf_weights import iter_hf_weights

PROMPTS = [[5, 17, 33, 2, 250, 9, 9, 41, 7, 100, 3], [8, 1, 200, 45, 6]]


class ThreadGroup:
    """The all-reduce of a TP group whose ranks are threads: every rank gets the sum of
    all ranks' tensors, added in rank order (so every rank gets the same bits)."""

    def __init__(self, size: int):
        self.parts: list[torch.Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=120)

    def member(self, rank: int) -> ThreadGroupMember:
        return ThreadGroupMember(self, rank)


class ThreadGroupMember:
    def __init__(self, group: ThreadGroup, rank: int):
        self.group, self.rank = group, rank

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        g = self.group
        g.parts[self.rank] = x
        g.barrier.wait()  # every rank's part is in
        total = g.parts[0].clone()
        for part in g.parts[1:]:
            total += part
        g.barrier.wait()  # every rank has read the parts: the next call may overwrite
        return total


def run_ranks(fn, tp: int) -> list:
    """fn(rank) in tp threads at once; their results in rank order (re-raises)."""
    results: list = [None] * tp
    errors: list[BaseException] = []

    def body(rank: int) -> None:
        try:
            with torch.inference_mode():
                results[rank] = fn(rank)
        except BaseException as e:  # re-raised below
            errors.append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("tp", [2, 4])  # tp 2 splits the 2 KV heads; tp 4 replicates them
def test_tp_ranks_together_equal_one_rank(llama8_dir, load_llama, prefill_batch, tp):
    one = LayerContext()
    single = load_llama(llama8_dir, one)
    with torch.inference_mode():
        want = single(prefill_batch(single, PROMPTS, one))  # [T, hidden]
        want_logits = single.compute_logits(want)
    group = ThreadGroup(tp)
    ctxs = [LayerContext(parallel=ParallelContext(r, tp, group.member(r))) for r in range(tp)]
    models = [load_llama(llama8_dir, ctx) for ctx in ctxs]
    batches = [prefill_batch(m, PROMPTS, ctx) for m, ctx in zip(models, ctxs)]
    cfg = single.cfg
    for m, b in zip(models, batches):
        attn = m.layers[0].self_attn
        assert attn.num_heads == cfg.num_heads // tp
        assert attn.num_kv_heads == b.kv_cache.k.shape[2] == max(1, cfg.num_kv_heads // tp)
    outs = run_ranks(lambda r: models[r](batches[r]), tp)
    for out in outs:
        assert torch.equal(out, outs[0])  # every rank holds the same reduced stream
    # NOTE: the reduce sums the heads' and the MLP's partial products in another order
    torch.testing.assert_close(outs[0], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(models[0].compute_logits(outs[0]), want_logits, atol=1e-4, rtol=0)


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
