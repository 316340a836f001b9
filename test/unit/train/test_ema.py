"""--ema-decay's weight average: the running mean first, then the EMA, computed by
hand; evaluation inside `applied` sees the average and the weights come back exactly."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.train.ema import WeightAverage


def test_the_average_is_the_running_mean_then_the_ema():
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3, generator=gen))
    q = torch.nn.Parameter(torch.randn(7, generator=gen))
    decay = 0.75  # 1 - decay = 0.25: the running mean's 1/n until n = 4
    average = WeightAverage([p, q], decay)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    want = None
    for n in range(1, 9):
        with torch.no_grad():
            p.add_(torch.randn(p.shape, generator=gen))
            q.mul_(0.9)
        seen.append((p.detach().clone(), q.detach().clone()))
        average.update()
        if n <= 4:
            want = [torch.stack([s[i] for s in seen]).mean(0) for i in range(2)]
        else:
            assert want is not None
            want = [w + 0.25 * (x - w) for w, x in zip(want, seen[-1])]
        for got, w in zip(average.average, want):
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6)


def test_applied_swaps_the_average_in_and_restores_the_weights_exactly():
    p = torch.nn.Parameter(torch.arange(6.0))
    average = WeightAverage([p], 0.5)
    average.update()
    with torch.no_grad():
        p.add_(10.0)
    average.update()  # the mean of arange and arange + 10
    before = p.detach().clone()
    with average.applied():
        torch.testing.assert_close(p.detach(), torch.arange(6.0) + 5.0)
    assert torch.equal(p.detach(), before) and p.requires_grad
    average.store()
    torch.testing.assert_close(p.detach(), torch.arange(6.0) + 5.0)


@pytest.mark.parametrize("decay", [0.0, 1.0, -0.1])
def test_a_decay_outside_the_open_interval_is_refused(decay):
    with pytest.raises(ValueError, match="EMA decay"):
        WeightAverage([torch.nn.Parameter(torch.zeros(1))], decay)
