"""The rotary kernel and the decode kernel (RoPE inside) compiled for sm_90 on the CPU
(benchmarks/kernel_resources.py): their PTX rotates with the reference's roundings,
no half-precision FMA (LLVM fuses a plain `x * cos + xp * sin` into fma.rn.bf16, one
product unrounded)."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # NOTE: must precede every triton import

import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))

# run in a child process: this one's kernels run in the interpreter
CHILD = """
import json, sys
import kernel_resources as kr

ptx = {}
for dtype in ("bf16", "fp16", "fp32"):
    for store in (False, True):
        ptx[f"rotary {dtype} store={store}"] = kr.build_rotary(
            90, "llama-3.1-8b", dtype, store
        ).asm["ptx"]
for row in kr.ROWS:
    if row[3]:  # RoPE inside
        ptx[f"decode {row[0]}"] = kr.build(90, "llama-3.1-8b", row, False, 4)[2].asm["ptx"]
json.dump(ptx, sys.stdout)
"""


def test_rope_ptx_has_no_fma():
    """The 8B's heads (head dim 128): the rotary kernel in bf16, fp16 and fp32, and the
    bf16 decode kernel's decode and packed verify rows, each rotation's products and sum
    rounded ops of their own (mul.rn.f32, add.rn.f32)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=os.path.join(ROOT, "benchmarks"), env=env,
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    ptx = json.loads(run.stdout)
    assert len(ptx) == 8
    fmas = {name: len(re.findall(r"\bfma\.rn\.(?:bf16|f16)", text)) for name, text in ptx.items()}
    assert not any(fmas.values()), f"half-precision FMAs per build: {fmas}"
    for name, text in ptx.items():
        assert "mul.rn.f32" in text and "add.rn.f32" in text, name
        if name.startswith("rotary"):  # its only float math is the rotation's
            assert "fma." not in text, name
