"""The serving processes' collector settings (gc_heap.py)."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

from gyrfalcon.gc_heap import GEN0_THRESHOLD, GcPauses


def test_pauses_count_each_generation_and_stop_when_uninstalled():
    pauses = GcPauses().install()
    try:
        gc.collect()
        gc.collect(0)
    finally:
        pauses.uninstall()
    assert pauses.passes[2] >= 1 and pauses.passes[0] >= 1, pauses.passes
    assert pauses.seconds[2] > 0 and 0 < pauses.longest_s <= sum(pauses.seconds)
    before = list(pauses.passes)
    gc.collect()
    assert pauses.passes == before, "counted after uninstall"
    assert pauses.summary().startswith(f"gc: {before[0]} / {before[1]} / {before[2]} collections")


def test_frozen_heap_leaves_later_cycles_collectable():
    # NOTE: in a child: freezing this test process would keep every later test's
    # cyclic garbage for good
    code = textwrap.dedent(
        """
        import gc, weakref
        from gyrfalcon.gc_heap import freeze_startup_heap
        class Node:
            pass
        old = Node(); old.me = old
        freeze_startup_heap()
        new = Node(); new.me = new
        ref = weakref.ref(new)
        del new
        gc.collect()
        print(gc.get_freeze_count() > 0, ref() is None, gc.get_threshold()[0])
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    frozen, collected, gen0 = out.stdout.split()
    assert frozen == "True", "nothing frozen"
    assert collected == "True", "a cycle made after the freeze was never collected"
    assert int(gen0) == GEN0_THRESHOLD
