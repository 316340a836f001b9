"""Registers, stack (spills) and shared memory the decode attention kernel gets from the
compiler, on this machine, GPU or not: Triton lowers the kernel for an NVIDIA target,
its bundled ptxas assembles a cubin, and cuobjdump reads the resources. What a launch
configuration will cost in registers, before a GPU session measures its speed
(benchmarks/NOTES.md, stop 38: the 8B's head dim spilled at 4 warps).

  usage: python benchmarks/kernel_resources.py [--arch 90] [--warps 4,8]
         [--block-n 0,32] [--early-kv] [--output-json F]
  (--block-n 0: the kernel's own choice, `decode_block_params`). Run without
  TRITON_INTERPRET: the interpreter compiles nothing.

Each row is one build of `_decode_split_kernel` as `decode_attention` would launch it
(`decode_constexprs`), for the 8B's and SmolLM2's heads: decode rows (RoPE inside), a
MIXED step's decode rows (RoPE apart), packed verify rows of k + 1 = 4 tokens, with a
bf16 or an fp8 cache. `build_rotary` compiles the rotary kernel alike (its PTX is
tested: test/unit/kernels/test_rotary_ptx.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

SHAPES = {"llama-3.1-8b": (32, 8, 128), "smollm2-135m": (9, 3, 64)}
# (name, query tokens per row, packed, RoPE inside)
ROWS = [
    ("decode", 1, False, True),
    ("mixed decode rows", 1, False, False),
    ("packed verify", 4, True, True),
]
SPLITS = 4  # NOTE: registers barely move with it (1-16 measured at stop 38)


def signature(kernel, consts: dict, types: dict) -> dict:
    """Triton's types for the kernel's arguments: consts' are constexpr, the others as
    `types` names them, or i32."""
    return {n: "constexpr" if n in consts else types.get(n, "i32") for n in kernel.arg_names}


def compile_kernel(kernel, consts: dict, types: dict, arch: int, **options):
    """Triton's compiled `kernel` for sm_`arch` (its PTX: `.asm["ptx"]`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    src = ASTSource(kernel, signature(kernel, consts, types), consts)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)


def resources(cubin: bytes) -> dict:
    """cuobjdump -res-usage of one kernel's cubin: registers, stack bytes."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True)
    line = next(x for x in out.stdout.splitlines() if "REG:" in x)
    fields = dict(kv.split(":", 1) for kv in line.split() if ":" in kv)
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"])}


def build(
    arch: int, shape: str, row: tuple, fp8: bool, warps: int, block_n: int = 0, early: bool = False
):
    """(compile-time arguments, pipeline stages, Triton's compiled kernel) of one build of
    the decode kernel for `shape`'s heads and `row` (an entry of ROWS); block_n 0: the
    kernel's own; early: the first key block read before the PDL gate (EARLY_KV)."""
    import torch

    from gyrfalcon.kernels.attention_decode import _decode_split_kernel
    from gyrfalcon.kernels.attention_launch import decode_constexprs

    heads, kv_heads, head_dim = SHAPES[shape]
    _, t, pack, rope = row
    consts, stages = decode_constexprs(
        head_dim, heads // kv_heads, t, pack, SPLITS, 16, torch.bfloat16, fp8, rope, True,
        block_n or None, None, early,
    )  # fmt: skip
    # bf16 activations, `kv` caches, int64 tables (as graph replays pass them), float32
    # partials and cos/sin
    kv = "*fp8e4nv" if fp8 else "*bf16"
    types = dict(
        q_ptr="*bf16", k_ptr=kv, v_ptr=kv, page_table_ptr="*i64", seq_lens_ptr="*i64",
        mid_o_ptr="*fp32", mid_lse_ptr="*fp32", count_ptr="*i32", o_ptr="*bf16",
        k_new_ptr="*bf16", v_new_ptr="*bf16", pos_ptr="*i64", cos_sin_ptr="*fp32",
        loc_ptr="*i64", qk_scale="fp32",
    )  # fmt: skip
    compiled = compile_kernel(
        _decode_split_kernel, consts, types, arch, num_warps=warps, num_stages=stages
    )
    return consts, stages, compiled


def build_rotary(arch: int, shape: str, dtype: str, store: bool):
    """Triton's compiled rotary kernel for `shape`'s heads in `dtype` (a Triton type:
    bf16, fp16, fp32), as `rotary_inplace` (store False) or `rotary_and_store` launch
    it."""
    from gyrfalcon.kernels.rotary import ROTARY_WARPS, _rotary_kernel, rotary_constexprs

    heads, kv_heads, head_dim = SHAPES[shape]
    consts = rotary_constexprs(head_dim, max(heads, kv_heads), store)
    x = "*" + dtype
    types = dict(
        q_ptr=x, k_ptr=x, pos_ptr="*i64", cache_ptr="*fp32", v_ptr=x, kc_ptr=x, vc_ptr=x,
        loc_ptr="*i64",
    )  # fmt: skip
    return compile_kernel(_rotary_kernel, consts, types, arch, num_warps=ROTARY_WARPS)


def compile_row(
    arch: int, shape: str, row: tuple, fp8: bool, warps: int, block_n: int, early: bool
) -> dict:
    consts, stages, compiled = build(arch, shape, row, fp8, warps, block_n, early)
    return {
        "shape": shape, "rows": row[0], "kv_cache": "fp8_e4m3" if fp8 else "bf16",
        "early_kv": early,
        "num_warps": warps, "block_n": consts["BLOCK_N"], "num_stages": stages,
        "shared_bytes": compiled.metadata.shared, **resources(compiled.asm["cubin"]),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--block-n", default="0,32", help="keys per iteration; 0: the kernel's own")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument(
        "--early-kv", action="store_true", help="builds that read a key block before the gate"
    )
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: the interpreter compiles nothing")
    table = []
    for shape in args.shapes.split(","):
        for row in ROWS:
            for fp8 in (False, True):
                for warps in map(int, args.warps.split(",")):
                    for block_n in map(int, args.block_n.split(",")):
                        r = compile_row(args.arch, shape, row, fp8, warps, block_n, args.early_kv)
                        table.append(r)
                        print(
                            f"| {shape} | {r['rows']} | {r['kv_cache']} | {warps} | {r['block_n']}"
                            f" | {r['registers']} | {r['stack_bytes']} | {r['shared_bytes']} |",
                            flush=True,
                        )
    if args.output_json:
        import triton

        from gyrfalcon.bench import report_json
        from gyrfalcon.bench.provenance import git_commit

        report = {
            "bench": "kernel_resources", "target": f"sm_{args.arch}", "triton": triton.__version__,
            "commit": git_commit(), "splits": SPLITS, "rows": table,
        }  # fmt: skip
        report_json.write(args.output_json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
