"""The default of `--piecewise-cuda-graph-max-tokens`: how large a step runs through
graphs (piecewise, or one whole graph on triton) rather than eagerly.

A graph replaces a forward's launches (an eager step launches ~0.7 ms of kernels a
layer, whatever its size) and pads the step up to a captured size (at most 12.5% above
1,024 tokens, `contract.piecewise_sizes`). While a step's device time stays under its
eager launches the step is launch-bound: graphs cut it to its device time, and the
padding costs little. Once the device time passes the launches, the overlap scheduler
hides them anyway and only the padding is left. So a model whose largest step stays
launch-bound gets graphs up to that step; the rest keep the measured 512.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gyrfalcon.config.model_config import ModelConfig

# NOTE: the measured default (benchmarks/NOTES.md, stop 54 and 55): the Llama-3.1-8B
# shape's served checks read 1.6-2.6% slower with graphs up to 8,448 tokens
DEFAULT_MAX_TOKENS = 512
# NOTE: measured on nvidia-h200 with benchmarks/bench_arrival_step.py (stop 54): an eager
# step's host time a layer, SmolLM2 20.2 ms / 30 layers and the 8B 23.4 ms / 32 layers
EAGER_LAUNCH_S_PER_LAYER = 0.7e-3
# NOTE: the same benchmark: the 8B's arrival step (1,088 tokens) ran at ~520 TFLOP/s
STEP_FLOP_PER_S = 520e12


def active_params_per_layer(cfg: ModelConfig) -> float:
    """Weights one token multiplies by in a decoder layer: q, k, v, o and the MLP (a MoE
    layer's top-k experts), averaged over the layers."""
    dense = 3 * cfg.hidden_size * cfg.intermediate_size
    moe = 3 * cfg.hidden_size * cfg.moe_intermediate_size * cfg.num_experts_per_tok
    num_moe = len(cfg.moe_layers)
    mlp = (num_moe * moe + (cfg.num_layers - num_moe) * dense) / cfg.num_layers
    return cfg.attention_weights + mlp


def launch_bound_tokens(cfg: ModelConfig) -> int:
    """The step size (tokens) at which a layer's device time, 2 FLOPs a weight a token
    at STEP_FLOP_PER_S, reaches its eager launches: below it a step is launch-bound.
    NOTE: the whole model's weights, also on TP ranks: a rank's share runs faster but
    launches its all-reduces too, and grouped expert GEMMs run below STEP_FLOP_PER_S;
    neither is measured, so those keep the estimate of one GPU (the smaller side)."""
    flop_per_token = 2 * active_params_per_layer(cfg)
    return int(EAGER_LAUNCH_S_PER_LAYER * STEP_FLOP_PER_S / flop_per_token)


def launch_bound_at(cfg: ModelConfig | None, largest_step: int, on_gpu: bool) -> bool:
    """Whether the model is known, on a GPU, and launch-bound up to largest_step (a
    prompt chunk beside every running row). SmolLM2-135M is launch-bound to ~51,000
    tokens, the 8B to ~830, Qwen3-30B-A3B to ~3,200, Mixtral-8x7B to ~460."""
    return cfg is not None and on_gpu and launch_bound_tokens(cfg) >= largest_step
