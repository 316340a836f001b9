"""The Triton compile watch: kernels first built after the warm-up are counted and
named in the worker's exit line."""

import logging

import pytest

from gyrfalcon.worker import compile_watch
from gyrfalcon.worker.compile_watch import CompileWatch, kernel_name

SPEC = "decode_attn_kernel[num_warps=4, num_ctas=1, num_stages=2](q: *bf16, n: i32)"


# a key as long as a real kernel's (~1,000 characters: 55 arguments), constexprs last
KEY = str([("*bf16", "D")] * 45 + [("i32", "")] * 8 + [("constexpr", 8), ("constexpr", 16)])


def _hook_kwargs(spec: str) -> dict:
    # the keywords Triton passes its JIT hooks (triton.knobs.JITHook)
    return dict(key=KEY, repr=spec, fn=None, compile={}, is_manual_warmup=False,
                already_compiled=False)  # fmt: skip


def test_kernel_name_from_triton_description():
    assert kernel_name(SPEC) == "decode_attn_kernel"
    assert kernel_name("plain(x: i32)") == "plain"


def test_summary_names_each_kernel_built(caplog, monkeypatch):
    # NOTE: a logger of its own: an earlier test's logging set-up may have disabled or
    # detached the module's (dictConfig disables the loggers that exist)
    monkeypatch.setattr(compile_watch, "logger", logging.getLogger("test.compile_watch"))
    watch = CompileWatch()
    assert watch.summary() == "no Triton kernel built while serving"
    with caplog.at_level(logging.WARNING, logger="test.compile_watch"):
        for spec in (SPEC, SPEC, "argmax_kernel[num_warps=8](x: *bf16)"):
            assert watch.before(**_hook_kwargs(spec)) is None  # None: Triton goes on
            watch.after(**_hook_kwargs(spec))
    text = watch.summary()
    assert text.startswith("3 Triton kernels built while serving")
    assert "decode_attn_kernel x2" in text and "argmax_kernel x1" in text
    logged = [r.getMessage() for r in caplog.records if "warm-up missed it" in r.getMessage()]
    # the whole specialization shows, constexprs included, and the arguments' names
    assert len(logged) == 3 and KEY in logged[0] and "(q: *bf16, n: i32)" in logged[0]


def test_every_installed_watch_hears_tritons_hooks_until_it_leaves():
    # one pair of hooks a process: a second engine's watch (or a test's) beside a
    # first one's hears every build too; leaving, or being dropped, stops only that
    # watch, and another party's hooks are never replaced
    import gc

    knobs = pytest.importorskip("triton").knobs
    rt = knobs.runtime
    saved = rt.jit_cache_hook, rt.jit_post_compile_hook
    rt.jit_cache_hook = rt.jit_post_compile_hook = None

    def build(spec: str) -> None:
        assert rt.jit_cache_hook(**_hook_kwargs(spec)) is None  # None: Triton goes on
        rt.jit_post_compile_hook(**_hook_kwargs(spec))

    try:
        first, second = CompileWatch(), CompileWatch()
        assert first.install() and second.install()
        build(SPEC)
        assert first.counts["decode_attn_kernel"] == second.counts["decode_attn_kernel"] == 1
        first.uninstall()
        build(SPEC)
        assert first.counts["decode_attn_kernel"] == 1
        assert second.counts["decode_attn_kernel"] == 2
        dropped = CompileWatch()
        assert dropped.install()
        del dropped
        gc.collect()
        second.uninstall()
        assert rt.jit_cache_hook is None and rt.jit_post_compile_hook is None
        own = rt.jit_cache_hook = lambda **_: None
        assert not CompileWatch().install(), "another party's hook must stay"
        assert rt.jit_cache_hook is own
    finally:
        rt.jit_cache_hook, rt.jit_post_compile_hook = saved
