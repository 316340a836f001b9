"""The default of --piecewise-cuda-graph-max-tokens: graphs up to the largest step for a
model whose steps stay launch-bound on a GPU (SmolLM2), the measured 512 otherwise."""

import pytest
from bench_scripts import bench_model_config as cfg

from gyrfalcon.config.piecewise import (
    DEFAULT_MAX_TOKENS,
    active_params_per_layer,
    launch_bound_tokens,
)
from gyrfalcon.config.server_args import ServerArgs


def gpu(model: str, **kw) -> int | None:
    args = ServerArgs(device="cuda", dtype="bfloat16", **kw).resolved(cfg(model))
    return args.piecewise_cuda_graph_max_tokens


def test_weights_a_token_meets_match_the_published_sizes():
    # Llama-3.1-8B: 8.03e9 parameters, 2 x 128,256 x 4,096 of them in the embedding and
    # the LM head, the rest over 32 layers (norms aside)
    per_layer = (8.030e9 - 2 * 128_256 * 4_096) / 32
    assert active_params_per_layer(cfg("llama-3.1-8b")) == pytest.approx(per_layer, rel=0.01)
    # Qwen3-30B-A3B: ~3.3e9 active parameters; a token meets its top 8 of 128 experts only
    moe = cfg("qwen3-30b-a3b")
    active = active_params_per_layer(moe) * moe.num_layers
    assert 2.5e9 < active < 3.3e9


def test_a_small_model_gets_graphs_up_to_its_largest_step_on_a_gpu():
    assert launch_bound_tokens(cfg("smollm2-135m")) > 8192 + 256
    assert gpu("smollm2-135m") == 8192 + 256  # the default chunk beside 256 rows
    assert gpu("smollm2-135m", chunked_prefill_size=1024, max_num_seqs=64) == 1088
    # never above the step budget
    assert gpu("smollm2-135m", chunked_prefill_size=4096, max_num_batched_tokens=4096) == 4096


def test_a_large_model_keeps_the_measured_default():
    for name in ("llama-3.1-8b", "qwen3-8b", "qwen3-30b-a3b", "mixtral-8x7b"):
        assert launch_bound_tokens(cfg(name)) < 8192, name
        assert gpu(name) == DEFAULT_MAX_TOKENS == 512, name


def test_the_cpu_an_unknown_model_and_an_explicit_value_keep_theirs():
    assert (
        ServerArgs(device="cpu").resolved(cfg("smollm2-135m")).piecewise_cuda_graph_max_tokens
        == 512
    )
    assert (
        ServerArgs(device="cuda", dtype="bfloat16").resolved().piecewise_cuda_graph_max_tokens
        == 512
    )
    assert gpu("smollm2-135m", piecewise_cuda_graph_max_tokens=0) == 0
    assert gpu("llama-3.1-8b", piecewise_cuda_graph_max_tokens=2048) == 2048


def test_a_model_launch_bound_at_its_largest_step_defaults_to_triton(monkeypatch):
    """Whole-step graphs exist on triton only: SmolLM2's first tokens came sooner there
    and its output on par or better (stop 56)."""
    import importlib.util

    # NOTE: as if flashinfer were installed (it is not on the CPU machines)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n: object() if n == "flashinfer" else find_spec(n)
    )

    def backends(model: str, **kw) -> tuple[str, str]:
        a = ServerArgs(device="cuda", dtype="bfloat16", **kw).resolved(cfg(model))
        return a.attention_backend, a.decode_attention_backend

    assert backends("smollm2-135m") == ("triton", "triton")
    assert backends("llama-3.1-8b") == ("flashinfer", "triton")
    assert backends("qwen3-30b-a3b") == ("flashinfer", "triton")
    # graphs that stop short of the largest step, an explicit backend, no model: as before
    assert backends("smollm2-135m", piecewise_cuda_graph_max_tokens=512)[0] == "flashinfer"
    assert backends("smollm2-135m", attention_backend="flashinfer")[0] == "flashinfer"
    assert ServerArgs(device="cuda", dtype="bfloat16").resolved().attention_backend == (
        "flashinfer"
    )
