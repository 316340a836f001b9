"""What each Triton kernel reads before its PDL gate (kernels/pdl.pdl_gate).

With programmatic dependent launch a kernel starts while the previous one still runs:
before the gate it may read only what no kernel of the forward writes: weights, the
batch's metadata and the KV cache of earlier steps' tokens. A read of the previous
kernel's output there is a race that no output comparison catches reliably (it passes
whenever the previous kernel happens to finish first). So the pointers each kernel
touches before its gate are pinned here, from the source: a new early read has to be
added to this table, with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import gyrfalcon.kernels

KERNELS = Path(gyrfalcon.kernels.__file__).parent

# kernel -> the pointer arguments it dereferences before pdl_gate, and why that is safe
EARLY_READS = {
    # the batch's metadata, written before the forward's first kernel (lengths,
    # positions, cos/sin, page ids), and (EARLY_KV builds) the split's first key block
    # masked to the positions before the row's new tokens: earlier steps' K/V; a block
    # holding a new token is read again after the gate (test_triton_attention_early)
    "_decode_split_kernel": {
        "seq_lens_ptr",
        "pos_ptr",
        "cos_sin_ptr",
        "page_table_ptr",
        "k_ptr",
        "v_ptr",
    },
    # weights (the projection and the RMSNorm gamma; the skinny GEMM's first K step)
    "_norm_gemv_kernel": {"w_ptr", "gamma_ptr"},
    "_skinny_gemm_kernel": {"w_ptr"},
}


def _gated_kernels() -> dict[str, tuple[ast.FunctionDef, int]]:
    """Every function of gyrfalcon/kernels that calls pdl_gate: (its node, the index of
    the body statement that holds the call)."""
    found = {}
    for path in sorted(KERNELS.glob("*.py")):
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, ast.FunctionDef) or fn.name == "pdl_gate":
                continue
            for i, stmt in enumerate(fn.body):
                calls = [c for c in ast.walk(stmt) if isinstance(c, ast.Call)]
                if any(getattr(c.func, "id", None) == "pdl_gate" for c in calls):
                    found[fn.name] = (fn, i)
                    break
    return found


def _dereferenced(stmts: list[ast.stmt]) -> set[str]:
    """The `*_ptr` names these statements use other than for their type (`p.dtype`)."""
    used = set()
    for stmt in stmts:
        typed = {
            id(n.value)
            for n in ast.walk(stmt)
            if isinstance(n, ast.Attribute) and n.attr == "dtype"
        }
        for n in ast.walk(stmt):
            if isinstance(n, ast.Name) and n.id.endswith("_ptr") and id(n) not in typed:
                used.add(n.id)
    return used


def test_early_reads_are_weights_and_metadata_only() -> None:
    gated = _gated_kernels()
    assert set(EARLY_READS) <= set(gated)
    for name, (fn, i) in gated.items():
        gate = fn.body[i]
        # NOTE: a gate inside a branch would leave "before" undefined for this check
        assert isinstance(gate, ast.Expr), f"{name}: pdl_gate is not a statement of its own"
        assert _dereferenced(fn.body[:i]) == EARLY_READS.get(name, set()), name


def test_the_check_sees_an_early_read() -> None:
    src = (
        "def k(x_ptr, w_ptr, PDL):\n"
        "    dtype = x_ptr.dtype.element_ty\n"
        "    w = tl.load(w_ptr)\n"
        "    y = helper(x_ptr + 1)\n"
        "    pdl_gate(PDL)\n"
    )
    fn = ast.parse(src).body[0]
    assert isinstance(fn, ast.FunctionDef)
    assert _dereferenced(fn.body[:3]) == {"w_ptr", "x_ptr"}  # the type use alone is not one
    assert _dereferenced(fn.body[:2]) == {"w_ptr"}
