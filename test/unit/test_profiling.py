"""The kernel-profile window of a served worker (`GYRFALCON_KERNEL_PROFILE`), and the
host section timer of the benchmarks and served workers (`SectionTimes`,
`GYRFALCON_SECTION_TIMES`)."""

import os
import types

import pytest
import torch

from gyrfalcon.profiling import KernelWindow, SectionTimes, kernel_windows, process_sections
from gyrfalcon.worker.sections import worker_sections


class _Stepper:
    def step(self, n: int) -> int:
        return self.inner(n) + 1

    def inner(self, n: int) -> int:
        return 2 * n


def test_section_times_count_calls_and_restore_the_callables():
    mod = types.ModuleType("m")
    mod.helper = lambda x: x + 10
    before = (_Stepper.__dict__["step"], _Stepper.__dict__["inner"], mod.helper)
    targets = {"step": (_Stepper, "step"), "inner": (_Stepper, "inner"), "helper": (mod, "helper")}
    with SectionTimes(targets) as times:
        s = _Stepper()
        assert [s.step(i) for i in range(3)] == [1, 3, 5] and mod.helper(1) == 11
    assert times.calls == {"step": 3, "inner": 3, "helper": 1}
    assert times.seconds["step"] >= times.seconds["inner"] > 0  # NOTE: totals nest
    assert (_Stepper.__dict__["step"], _Stepper.__dict__["inner"], mod.helper) == before
    table = times.table(3, "step")
    assert "| step | 3 |" in table and "ms per step" in table


def test_kernel_window_profiles_exactly_its_plans(tmp_path):
    window = KernelWindow("worker3", f"{tmp_path}:2:3")
    cpu = torch.device("cpu")
    for plan in range(1, 7):
        window.plan(cpu)
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))  # the plan's work
        written = (tmp_path / "kernels_worker3.txt").exists()
        assert written == (plan >= 5)  # closed before plan 5: plans 2, 3, 4 inside
    text = (tmp_path / "kernels_worker3.txt").read_text()
    assert text.startswith("worker3: plans 2 .. 4") and "aten::mm" in text


def test_kernel_windows_profile_a_prefill_and_a_decode_apart(tmp_path):
    """DIR:FIRST:COUNT,FIRST:COUNT: each window its own file, written as it closes."""
    window = KernelWindow("worker1", f"{tmp_path}:1:2,5:1")
    cpu = torch.device("cpu")
    for plan in range(1, 8):
        window.plan(cpu)
        if plan in (1, 2):
            torch.mm(torch.ones(8, 8), torch.ones(8, 8))  # the "prefill"
        else:
            torch.add(torch.ones(8), 1)
    first = (tmp_path / "kernels_worker1.txt").read_text()
    second = (tmp_path / "kernels_worker1_5.txt").read_text()
    assert first.startswith("worker1: plans 1 .. 2") and "aten::mm" in first
    assert second.startswith("worker1: plans 5 .. 5") and "aten::mm" not in second
    assert "aten::add" in second and "aten::add" not in first


def test_kernel_windows_must_be_in_order_and_apart():
    assert kernel_windows("d") == ("d", [(300, 399)])
    assert kernel_windows("d:2:6,100:50") == ("d", [(2, 7), (100, 149)])
    for bad in ("d:5:3,6:2", "d:5:3,8:1", "d:0:3", "d:4:0"):
        with pytest.raises(ValueError, match="in order"):
            kernel_windows(bad)


def test_kernel_window_is_off_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("GYRFALCON_KERNEL_PROFILE", raising=False)
    window = KernelWindow("worker0")
    for _ in range(400):
        window.plan(torch.device("cpu"))
    assert window.prof is None and not list(tmp_path.iterdir())


def test_process_sections_time_the_block_per_plan_or_do_nothing(tmp_path, monkeypatch):
    """GYRFALCON_SECTION_TIMES=DIR: the sections' table, per plan, in DIR at the block's
    end; unset: the targets are never even built."""
    monkeypatch.delenv("GYRFALCON_SECTION_TIMES", raising=False)
    with process_sections("worker0", lambda: 1 / 0, lambda: 0):
        pass  # NOTE: 1 / 0 would raise if the targets were built
    monkeypatch.setenv("GYRFALCON_SECTION_TIMES", str(tmp_path))
    with process_sections("worker1", lambda: {"step": (_Stepper, "step")}, lambda: 4):
        s = _Stepper()
        for i in range(8):
            s.step(i)
    (name,) = os.listdir(tmp_path)
    assert name == f"sections_worker1_{os.getpid()}.md"
    text = (tmp_path / name).read_text()
    assert text.startswith("# worker1") and ": 4 plans" in text and "| step | 8 |" in text
    assert "ms per plan" in text and "step" in _Stepper.__dict__  # NOTE: restored


def test_the_worker_sections_name_callables_that_exist():
    """Every section of worker/sections.py names a callable that exists (a renamed
    method would otherwise drop out of the served and in-process tables)."""
    for name, (owner, attr) in worker_sections().items():
        assert callable(getattr(owner, attr)), name
