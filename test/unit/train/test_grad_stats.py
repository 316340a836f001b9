"""The clipping summary each held-out evaluation logs: the median gradient norm and
the share of steps clip_grad_norm_ scaled down."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.train.grad_stats import grad_norm_stats


def test_median_and_share_above_the_limit():
    s = grad_norm_stats([0.2, 0.9, 0.4, 1.5], max_norm=0.5)
    assert s.median == pytest.approx(0.65)  # even count: the mean of the middle two
    assert s.clipped_share == 0.5
    s = grad_norm_stats([3.0, 0.1, 0.7], max_norm=0.5)
    assert s.median == 0.7 and s.clipped_share == pytest.approx(2 / 3)


def test_the_trainer_records_the_norm_before_clipping():
    # what train_loop keeps: clip_grad_norm_'s return, the total norm it clipped from
    w = torch.nn.Parameter(torch.zeros(4))
    w.grad = torch.full((4,), 1.0)  # norm 2
    norm = torch.nn.utils.clip_grad_norm_([w], 0.5)
    assert float(norm) == pytest.approx(2.0)
    assert float(w.grad.norm()) == pytest.approx(0.5, rel=1e-4)
    s = grad_norm_stats([float(norm), 0.5], max_norm=0.5)  # at the limit: not counted
    assert s.clipped_share == 0.5 and s.median == pytest.approx(1.25)


def test_an_empty_window_is_refused():
    with pytest.raises(ValueError, match="no steps"):
        grad_norm_stats([], max_norm=0.5)
