"""The kernel-profile window of a served worker (`GYRFALCON_KERNEL_PROFILE`)."""

import torch

from gyrfalcon.profiling import KernelWindow


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
