"""benchmarks/kernel_resources.py: the decode kernel compiled for sm_90 on the CPU, and
the compile-time arguments it compiles with (`decode_constexprs`, which
`decode_attention` launches with)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: must precede every triton import

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402

from gyrfalcon.kernels.attention_launch import decode_constexprs  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def test_decode_constexprs_follow_the_launch():
    """Packed rows size the block by T x GROUP and write up to T new tokens; an fp8
    cache under a bf16 q does its dots in float16 with the fp8 block size; explicit
    block_n / num_stages win."""
    packed, stages = decode_constexprs(64, 3, 4, True, 4, 16, torch.bfloat16, False, True, True)
    assert (packed["BLOCK_H"], packed["BLOCK_T"], packed["BLOCK_N"], stages) == (16, 4, 64, 2)
    assert packed["PACK"] and packed["ROPE"] and not packed["F16_MATH"]
    wide, _ = decode_constexprs(64, 20, 3, True, 1, 16, torch.bfloat16, False, False, False)
    assert (wide["BLOCK_H"], wide["BLOCK_T"], wide["BLOCK_S"]) == (64, 4, 1)
    one, _ = decode_constexprs(128, 4, 4, False, 2, 16, torch.bfloat16, False, False, False)
    assert (one["BLOCK_H"], one["BLOCK_T"], one["BLOCK_D"]) == (16, 1, 128)
    fp8, stages = decode_constexprs(128, 4, 1, False, 8, 16, torch.bfloat16, True, True, True)
    assert fp8["F16_MATH"] and (fp8["BLOCK_N"], stages) == (128, 3)
    mine, stages = decode_constexprs(
        128, 4, 1, False, 8, 16, torch.float32, True, True, True, 32, 1
    )
    assert not mine["F16_MATH"] and (mine["BLOCK_N"], stages) == (32, 1)


def test_kernel_resources_compiles_for_sm90_on_the_cpu(tmp_path):
    """SmolLM2's heads, 4 warps, the kernel's own block: six builds (decode, MIXED decode
    rows, packed verify; bf16 and fp8 caches), each with registers, stack and shared
    memory as the compiler reports them (in a child process: this one's kernels run in
    the interpreter)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out_json = tmp_path / "kr.json"
    cmd = [
        sys.executable, os.path.join(ROOT, "benchmarks", "kernel_resources.py"),
        "--shapes", "smollm2-135m", "--warps", "4", "--block-n", "0",
        "--output-json", str(out_json),
    ]  # fmt: skip
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out_json.read_text())
    assert report["target"] == "sm_90" and len(report["rows"]) == 6
    kinds = {(r["rows"], r["kv_cache"]) for r in report["rows"]}
    assert kinds == {
        (rows, kv)
        for rows in ("decode", "mixed decode rows", "packed verify")
        for kv in ("bf16", "fp8_e4m3")
    }
    for r in report["rows"]:
        assert 0 < r["registers"] <= 255 and r["stack_bytes"] >= 0 and r["shared_bytes"] > 0
        assert r["block_n"] == (128 if r["kv_cache"] == "fp8_e4m3" else 64)
