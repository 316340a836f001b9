"""Tensor parallelism over torch.distributed (gloo, CPU): ranks are spawned processes
meeting at a free local port (`parallel_util.spawn_ranks`: a deadline, the others
killed when one fails, process groups destroyed). TP=2 prefill logits of tiny Llama
checkpoints equal one rank's (float32); the communicator reduces and gathers within
its TP group only; a rank whose peer vanished gets an error, not a hang."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import make_tiny_hf_model
from gloo_ranks import (
    COLLECTIVE_TIMEOUT,
    rank_checks_collectives,
    rank_fails_while_peer_waits,
    rank_outlives_its_peer,
    rank_tp_logits,
)
from parallel_util import load_model, prefill_batch, spawn_ranks

from gyrfalcon.layers.context import LayerContext

DEADLINE_S = 120  # a whole spawned run: start-up, loads, collectives
# NOTE: ids < 255 (the odd vocabulary); 127 | 128 is the tp 2 shard edge of 255 and 256
PROMPTS = [[5, 17, 33, 2, 254, 9, 9, 41, 7, 100, 3], [8, 1, 200, 45, 6], [127, 128, 0, 3]]
CHECKPOINTS = {
    # name: (make_tiny_hf_model arch, overrides)
    "llama-kv-split": ("llama", dict(num_attention_heads=8)),  # 2 KV heads: 1 a rank
    "llama-kv-replicated": ("llama", dict(num_key_value_heads=1)),  # 1 KV head on both
    "tied-odd-vocab": ("llama-tied", dict(vocab_size=255)),  # 128 rows a rank, 1 padding
    "qwen2-bias": ("qwen2", {}),  # q/k/v biases split with their heads
}


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory) -> dict[str, str]:
    dirs = {}
    for name, (arch, overrides) in CHECKPOINTS.items():
        dirs[name] = str(tmp_path_factory.mktemp(f"tp-{name}"))
        make_tiny_hf_model(dirs[name], arch, **overrides)
    return dirs


@pytest.fixture(scope="module")
def tp2_outputs(checkpoint_dirs, tmp_path_factory) -> list[dict]:
    """Each rank's {checkpoint: {"hidden", "logits", "embed_rows"}} of one TP=2 run."""
    out_dir = str(tmp_path_factory.mktemp("tp2-run"))
    spawn_ranks(rank_tp_logits, 2, out_dir, checkpoint_dirs, PROMPTS, timeout_s=DEADLINE_S)
    return [torch.load(f"{out_dir}/rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_tp2_logits_equal_one_ranks(checkpoint_dirs, tp2_outputs, name):
    ctx = LayerContext()
    model = load_model(checkpoint_dirs[name], ctx)
    with torch.inference_mode():
        hidden = model(prefill_batch(model, PROMPTS, ctx))
        want = model.compute_logits(hidden)
    rank0, rank1 = (out[name] for out in tp2_outputs)
    vocab = model.cfg.vocab_size
    assert rank0["embed_rows"] == rank1["embed_rows"] == -(-vocab // 2)
    # every rank holds the same reduced stream and all the vocabulary's logits
    assert torch.equal(rank0["hidden"], rank1["hidden"])
    assert torch.equal(rank0["logits"], rank1["logits"])
    assert rank0["logits"].shape == (sum(map(len, PROMPTS)), vocab)
    # NOTE: the all-reduce adds the two ranks' partial products: another float order
    torch.testing.assert_close(rank0["hidden"], hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rank0["logits"], want, atol=1e-4, rtol=1e-5)
    assert torch.equal(rank0["logits"].argmax(-1), want.argmax(-1))


def test_each_tp_group_reduces_and_gathers_its_own_ranks(tmp_path):
    """4 ranks, tp 2: groups {0, 1} and {2, 3}."""
    spawn_ranks(rank_checks_collectives, 4, str(tmp_path), 2, timeout_s=DEADLINE_S)


def test_a_rank_whose_peer_vanished_raises_instead_of_hanging(tmp_path):
    spawn_ranks(rank_outlives_its_peer, 2, str(tmp_path), timeout_s=DEADLINE_S)
    with open(tmp_path / "peer.json") as f:
        peer = json.load(f)
    assert peer["seconds"] <= COLLECTIVE_TIMEOUT.total_seconds() + 5, peer


def test_a_failing_rank_fails_the_run_at_once(tmp_path):
    """Rank 1 raises while rank 0 waits in a collective: the harness reports rank 1's
    error and kills rank 0 without waiting for the collective's timeout."""
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)rank 1:.*ValueError: rank 1 fails"):
        spawn_ranks(rank_fails_while_peer_waits, 2, str(tmp_path), timeout_s=DEADLINE_S)
    assert time.monotonic() - start < COLLECTIVE_TIMEOUT.total_seconds()
