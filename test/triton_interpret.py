"""Import first in a test module whose Triton kernels run in the interpreter (CPU): sets
TRITON_INTERPRET before triton is imported, and skips the importing module on a GPU
machine (kernels compile there once per session; test/gpu covers them, and the variable
is restored) or where the kernels were imported in compiled mode already."""

import os

_PRIOR_INTERPRET = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"  # NOTE: must precede every import of triton

import pytest  # noqa: E402
import torch  # noqa: E402

if torch.cuda.is_available():
    if _PRIOR_INTERPRET is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _PRIOR_INTERPRET
    pytest.skip("CPU interpreter tests; test/gpu covers CUDA", allow_module_level=True)
pytest.importorskip("triton")


def _speed_up_the_interpreter() -> None:
    """Two costs of triton's interpreter (3.x) that change no value, skipped: every call
    of a nested @triton.jit helper patches triton.language again (`_patch_lang`: five
    namespaces walked by inspect.getmembers, ~40 times a decode program) although its
    launch patched the same modules already and restores them at its end; and every
    dtype lookup builds a dict of every dtype (`_get_np_dtype`, ~100 calls a program).
    A helper of another module (triton.language.standard's `cdiv`, `sum`, ... see
    triton.language.core) patches that one once a launch. The CPU triton tests run
    ~35% faster (one attention test 32 -> 20 s). Where those internals are not there
    (another triton), nothing is patched."""
    import inspect

    import triton.language as tl
    from triton.runtime import interpreter as it

    names = ("_patch_lang", "_get_np_dtype", "_LangPatchScope", "GridExecutor")
    if not all(hasattr(it, n) for n in names) or getattr(it, "_gyr_faster", False):
        return
    patch_lang, np_dtype, grid_call = it._patch_lang, it._get_np_dtype, it.GridExecutor.__call__
    launched: list[frozenset | None] = []  # per launch in progress: the modules it patched

    def langs(fn) -> frozenset:
        mods = (tl, tl.core)
        return frozenset(
            id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in mods
        )

    def patch_once(fn):
        mine = langs(fn)
        if launched and launched[-1] is not None and mine <= launched[-1]:
            return it._LangPatchScope()  # NOTE: a helper inside the launch: patched already
        if launched:  # NOTE: the launch's own patch, or a helper's of another module
            launched[-1] = mine | (launched[-1] or frozenset())
        return patch_lang(fn)

    def call(self, *args, **kwargs):
        launched.append(None)
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            launched.pop()

    cache: dict = {}

    def cached_np_dtype(tt):
        if isinstance(tt, tl.block_type):
            tt = tt.element_ty
        if isinstance(tt, tl.pointer_type):
            return np_dtype(tt)
        got = cache.get(tt)
        if got is None:
            got = cache[tt] = np_dtype(tt)
        return got

    it._patch_lang, it._get_np_dtype, it.GridExecutor.__call__ = patch_once, cached_np_dtype, call
    it._gyr_faster = True


_speed_up_the_interpreter()

from gyrfalcon.kernels import attention_decode  # noqa: E402

if type(attention_decode._decode_split_kernel).__name__ != "InterpretedFunction":
    pytest.skip(
        "the kernels were imported in compiled mode before TRITON_INTERPRET was set",
        allow_module_level=True,
    )
