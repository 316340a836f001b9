"""A model that does not split over the ranks its flags ask for is refused when the
flags are resolved against its config (`config/sharding.py` check_parallel_fit, the
same shard functions the layers build with), before any process starts; `gyrfalcon
serve` then exits 2 with the reason. Before, each worker raised it after the launch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import make_tiny_eagle3, make_tiny_hf_model, tiny_target_config

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.config.server_args import ServerArgs

# SmolLM2-135M's attention and MLP: 9 query heads, 3 KV heads, intermediate 1536
SMOLLM2_SHAPE = dict(
    vocab_size=256, hidden_size=576, intermediate_size=1536, num_hidden_layers=2,
    num_attention_heads=9, num_key_value_heads=3,
)  # fmt: skip
QWEN3_MOE = dict(
    SMOLLM2_SHAPE, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
    num_attention_heads=8, num_key_value_heads=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=96, intermediate_size=102, mlp_only_layers=[0],
)  # fmt: skip


def resolve(hf: dict, **flags) -> ServerArgs:
    return ServerArgs(device="cpu", **flags).resolved(ModelConfig.from_hf(hf))


@pytest.mark.parametrize(
    "hf, flags, message",
    [
        (SMOLLM2_SHAPE, dict(tp_size=2), "--tp-size 2: 9 attention heads do not split over tp size 2"),
        (SMOLLM2_SHAPE, dict(tp_size=9), "--tp-size 9: size 1536 does not split over tp size 9"),
        (dict(SMOLLM2_SHAPE, num_attention_heads=12, num_key_value_heads=4), dict(tp_size=6),
         "neither a divisor nor a multiple of 4 KV heads"),
        # layer 0 is a dense MLP of 102: it splits over 2, not over 4
        (QWEN3_MOE, dict(tp_size=4, ep_size=4), "--tp-size 4 --dp-size 1 --ep-size 4: size 102"),
        # DP attention: the 8 experts split over all 3 ranks of the world
        (QWEN3_MOE, dict(dp_size=3, ep_size=3), "--ep-size 3: 8 experts do not split over ep size 3"),
        # MoE-TP: each expert's intermediate rows split over the TP group
        (dict(QWEN3_MOE, moe_intermediate_size=90, intermediate_size=96), dict(tp_size=4),
         "expert intermediate size 90 does not split over tp size 4"),
    ],
)  # fmt: skip
def test_a_model_that_does_not_split_is_refused_when_the_flags_resolve(hf, flags, message):
    with pytest.raises(ValueError, match=message):
        resolve(hf, **flags)


@pytest.mark.parametrize(
    "hf, flags",
    [
        (SMOLLM2_SHAPE, dict(tp_size=3)),  # 3 heads and 1 KV head a rank, MLP 512
        (SMOLLM2_SHAPE, dict(dp_size=2)),  # DP attention of a dense model splits nothing
        (QWEN3_MOE, dict(tp_size=2)),  # MoE-TP: experts of 48, the dense MLP 51
        (QWEN3_MOE, dict(tp_size=2, dp_size=2, ep_size=4)),  # 2 experts a rank
        (QWEN3_MOE, dict(tp_size=2, ep_size=2)),  # EP in the TP group
    ],
)  # fmt: skip
def test_models_that_split_resolve(hf, flags):
    assert resolve(hf, **flags).tp_size == flags.get("tp_size", 1)


def test_serve_exits_2_before_any_worker_starts(tmp_path):
    target = str(tmp_path / "target")
    make_tiny_hf_model(
        target, "llama", hidden_size=72, num_attention_heads=9, num_key_value_heads=3
    )
    cmd = [
        sys.executable,
        "-m",
        "gyrfalcon.cli",
        "serve",
        target,
        "--device",
        "cpu",
        "--tp-size",
        "2",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert (
        last == "gyrfalcon serve: error: --tp-size 2: 9 attention heads do not split over tp size 2"
    ), last
    assert "Traceback" not in done.stderr and "worker" not in done.stderr


def test_a_drafter_that_does_not_split_is_refused_beside_a_target_that_does(tmp_path):
    """Every TP rank runs the drafter split like the target: a drafter with 2 attention
    heads beside a target with 8 (2 KV heads) serves at tp 2 and is refused at tp 4."""
    draft = str(tmp_path / "draft")
    make_tiny_eagle3(draft, num_attention_heads=2, num_key_value_heads=2)
    spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=draft)
    ServerArgs(device="cpu", tp_size=2, **spec).resolved(tiny_target_config(8))
    with pytest.raises(ValueError, match=r"draft-model-path .*: --tp-size 4: 2 attention heads"):
        ServerArgs(device="cpu", tp_size=4, **spec).resolved(tiny_target_config(8))
    ServerArgs(device="cpu", tp_size=4).resolved(tiny_target_config(8))  # the target alone
