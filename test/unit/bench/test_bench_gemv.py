"""benchmarks/bench_gemv.py's table suggestions (pure functions; the sweep needs CUDA)."""

import pytest
import triton_interpret  # noqa: F401  NOTE: before the script, which imports triton
from bench_scripts import bench_script


@pytest.fixture(scope="module")
def bg():
    with bench_script("bench_gemv.py") as mod:
        yield mod


def row(layer, m, n, k, default_us, best_us, best="fma/n8/k512/w8/s4", swept=True):
    act = layer == "down_silu_mul"
    return dict(model="llama-3.1-8b", layer=layer, m=m, n=n, k=k, act_silu_mul=act,
                default_us=default_us, best_us=best_us, best_config=best, swept=swept)  # fmt: skip


def test_layers_the_engine_runs_through_the_default_config(bg):
    # at one row the fused down replaces the plain one; at more rows the plain one runs
    assert bg.runs_in_engine("down_silu_mul", 1, 14336) and not bg.runs_in_engine("down", 1, 14336)
    assert bg.runs_in_engine("down", 4, 14336) and not bg.runs_in_engine("down_silu_mul", 4, 14336)
    # qkv and gate_up of rows up to NORM_FUSED_MAX_K wide take the norm kernel at one row
    assert not bg.runs_in_engine("qkv", 1, 576) and not bg.runs_in_engine("gate_up", 1, 576)
    assert bg.runs_in_engine("qkv", 1, 4096) and bg.runs_in_engine("qkv", 4, 576)
    assert bg.runs_in_engine("o", 1, 576)


def test_suggests_swept_bests_over_three_percent_as_table_lines(bg):
    rows = [
        row("down_silu_mul", 1, 4096, 14336, 34.25, 32.09),  # 6.3%: suggested
        row("qkv", 4, 6144, 4096, 16.09, 14.30, best="dot/n64/k128/w4/s5"),  # 11%
        row("o", 1, 4096, 4096, 11.0, 10.8),  # 1.8%: within noise
        row("down", 1, 4096, 14336, 31.79, 29.93),  # the engine runs the fused one
        row("gate_up", 1, 28672, 4096, 59.4, 55.8, swept=False),  # not swept at this M
    ]
    lines = bg.suggestions(rows)
    assert len(lines) == 2
    fused, qkv = lines
    assert fused.startswith("    (4096, 14336, True, True): GemvConfig(8, 512, num_warps=8, ")
    assert "num_stages=4, use_dot=False)," in fused and "34.25 -> 32.09 us" in fused
    assert qkv.startswith("    (6144, 4096, False, False): GemvConfig(64, 128, num_warps=4, ")
    assert "use_dot=True)" in qkv
    # each line is a valid entry of the table: it evaluates to the swept config
    from gyrfalcon.kernels.gemv import GemvConfig

    key, cfg = eval("{" + fused.split("#")[0].strip().rstrip(",") + "}").popitem()
    assert key == (4096, 14336, True, True) and cfg == GemvConfig(8, 512, 8, 4, use_dot=False)
