"""`bench serve --plot`: the throughput series accounts for every output token at
its output's time, and the figure is written (a PNG a viewer opens)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gyrfalcon.bench.metrics import RequestResult
from gyrfalcon.bench.plot import plot_run, throughput_series, token_times


def result(start: float, ttft: float, itl: list[float], tokens: int) -> RequestResult:
    e2el = ttft + sum(itl)
    return RequestResult(True, "", 5, tokens, ttft, itl, e2el, start, "length")


RESULTS = [
    result(10.0, 0.5, [0.1, 0.1, 0.1], 4),  # outputs at 0.5, 0.6, 0.7, 0.8 s
    result(10.2, 0.3, [0.2], 4),  # two outputs of two tokens (a verify step each)
    RequestResult(False, "boom", start_time=10.1),  # failed: counts towards nothing
]


def test_token_times_place_each_output_relative_to_the_first_send():
    times, counts = token_times(RESULTS)
    assert times == pytest.approx([0.5, 0.6, 0.7, 0.8, 0.5, 0.7])
    assert counts.tolist() == [1, 1, 1, 1, 2, 2]


def test_throughput_series_sums_to_the_output_tokens():
    centres, rate = throughput_series(RESULTS, bins=8)
    width = centres[1] - centres[0]
    assert len(centres) == 8 and float(np.sum(rate) * width) == pytest.approx(8)
    assert throughput_series([RequestResult(False, "x")])[0].size == 0


def test_plot_writes_a_png(tmp_path: Path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "run.png"
    plot_run(RESULTS, str(path), "fake-model")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
