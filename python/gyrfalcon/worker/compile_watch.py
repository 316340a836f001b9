"""Triton kernels first used while serving.

A Triton kernel compiles (or loads from its disk cache) the first time a process
launches it with a new specialization: argument dtypes, constexprs, and integers
that are 1 or divisible by 16. The warm-up (worker/warmup.py) exists so that this
happens before the server reports ready; a specialization it misses costs the step
that meets it hundreds of milliseconds at a request's expense. `CompileWatch`, set
after the warm-up, logs each such first use with its time and counts them for the
worker's exit line, so a missed specialization shows instead of hiding in a mean.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import Counter
from typing import Any

logger = logging.getLogger(__name__)

# NOTE: Triton's hooks are one pair per process and outlive the worker that set them;
# every installed watch hears them through these two, weakly held, so a second engine in
# one process (train-eagle3's generation, then its evaluation; tests) watches too, and a
# dropped one stops. Set while any watch is installed.
_WATCHES: weakref.WeakSet[CompileWatch] = weakref.WeakSet()


def _before(**kw: object) -> None:
    for watch in list(_WATCHES):
        watch.before(**kw)


def _after(**kw: object) -> None:
    for watch in list(_WATCHES):
        watch.after(**kw)


def _runtime() -> Any:
    """Triton's runtime knobs (where its JIT hooks are set), or None without Triton."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs.runtime


def kernel_name(spec: str) -> str:
    """The kernel's name in Triton's description of a specialization
    ("name[num_warps=4, ...](arg: i32, ...)")."""
    return spec.split("[", 1)[0].split("(", 1)[0]


class CompileWatch:
    """Triton's JIT hooks (before and after a specialization is built) -> per-kernel
    counts and the seconds spent, from `install()` on."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.seconds = 0.0
        self._started: float | None = None

    def install(self) -> bool:
        """Hear Triton's hooks from now on; False where Triton is absent or another
        party's hooks are set (those are never replaced)."""
        rt = _runtime()
        if rt is None:
            return False
        hooks = rt.jit_cache_hook, rt.jit_post_compile_hook
        if hooks == (None, None):
            rt.jit_cache_hook, rt.jit_post_compile_hook = _before, _after
        elif hooks != (_before, _after):
            return False
        _WATCHES.add(self)
        return True

    def uninstall(self) -> None:
        """Stop hearing them; Triton's hooks are cleared once no watch is left."""
        _WATCHES.discard(self)
        rt = _runtime()
        if rt is None or _WATCHES:
            return
        if (rt.jit_cache_hook, rt.jit_post_compile_hook) == (_before, _after):
            rt.jit_cache_hook = rt.jit_post_compile_hook = None

    def before(self, *, repr: str, **_: object) -> None:
        """Triton is about to build `repr` (returns None: go on building it)."""
        self._started = time.perf_counter()

    def after(self, *, repr: str, key: object = "", **_: object) -> None:
        """Triton built `repr`; `key` (its cache key) says which specialization: every
        argument's type with "D" where a pointer or integer is divisible by 16."""
        took = time.perf_counter() - self._started if self._started is not None else 0.0
        self._started = None
        name = kernel_name(repr)
        self.counts[name] += 1
        self.seconds += took
        # NOTE: whole: the constexprs come last (a cut key hid NUM_SPLITS, stop 50), and
        # the description names the arguments the key's entries belong to, in order
        msg = "Triton built %s while serving (%.0f ms): warm-up missed it; specialization %s of %s"
        logger.warning(msg, name, took * 1e3, key, repr)

    def summary(self) -> str:
        if not self.counts:
            return "no Triton kernel built while serving"
        names = ", ".join(f"{name} x{n}" for name, n in self.counts.most_common())
        total = sum(self.counts.values())
        return f"{total} Triton kernels built while serving ({self.seconds:.1f} s): {names}"
