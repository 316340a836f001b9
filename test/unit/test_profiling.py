"""The kernel-profile window of a served worker (`GYRFALCON_KERNEL_PROFILE`), and the
host section timer of the benchmarks (`SectionTimes`)."""

import types

import torch

from gyrfalcon.profiling import KernelWindow, SectionTimes


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


def test_kernel_window_is_off_without_the_variable(tmp_path, monkeypatch):
    monkeypatch.delenv("GYRFALCON_KERNEL_PROFILE", raising=False)
    window = KernelWindow("worker0")
    for _ in range(400):
        window.plan(torch.device("cpu"))
    assert window.prof is None and not list(tmp_path.iterdir())
