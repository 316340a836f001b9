"""Metric math of the serving benchmark on hand-made timings."""

from __future__ import annotations

import pytest

from gyrfalcon.bench.metrics import (
    RequestResult,
    format_table,
    per_request_lists,
    percentile,
    percentile_label,
    summarize,
)


def _results() -> list[RequestResult]:
    return [
        RequestResult(
            success=True,
            prompt_tokens=10,
            output_tokens=5,
            ttft=0.1,
            itl=[0.1, 0.1, 0.1, 0.1],
            e2el=0.5,
        ),
        RequestResult(
            success=True, prompt_tokens=20, output_tokens=3, ttft=0.3, itl=[0.2, 0.2], e2el=0.7
        ),
        RequestResult(success=True, prompt_tokens=5, output_tokens=1, ttft=0.2, e2el=0.2),
        RequestResult(
            success=False,
            error="HTTP 500: boom",
            prompt_tokens=99,
            output_tokens=99,
            ttft=9.0,
            e2el=9.0,
        ),
    ]


def test_tpot_definition() -> None:
    r = _results()
    assert r[0].tpot == pytest.approx((0.5 - 0.1) / 4)
    assert r[1].tpot == pytest.approx((0.7 - 0.3) / 2)
    assert r[2].tpot is None  # one token: no TPOT
    assert r[3].tpot is None  # failed


def test_percentile_interpolates_and_handles_empty() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 99) is None
    assert percentile_label(99.0) == "99"
    assert percentile_label(99.9) == "99.9"


def test_summary_counts_and_throughput() -> None:
    s = summarize(_results(), duration=2.0)
    assert s["completed"] == 3 and s["failed"] == 1
    assert s["total_input_tokens"] == 35
    assert s["total_output_tokens"] == 9
    assert s["request_throughput"] == pytest.approx(1.5)
    assert s["input_throughput"] == pytest.approx(17.5)
    assert s["output_throughput"] == pytest.approx(4.5)
    assert s["total_token_throughput"] == pytest.approx(22.0)


def test_summary_latencies_in_ms() -> None:
    s = summarize(_results(), duration=2.0, percentiles=(90.0, 99.0))
    assert s["mean_ttft_ms"] == pytest.approx(200.0)
    assert s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p99_ttft_ms"] == pytest.approx(298.0)  # 200 + 0.98 * 100
    assert s["p90_ttft_ms"] == pytest.approx(280.0)
    assert s["mean_tpot_ms"] == pytest.approx(150.0)
    assert s["p99_tpot_ms"] == pytest.approx(199.0)  # 100 + 0.99 * 100
    assert s["mean_itl_ms"] == pytest.approx(800.0 / 6)
    assert s["median_itl_ms"] == pytest.approx(100.0)
    assert s["mean_e2el_ms"] == pytest.approx(1400.0 / 3)
    assert s["median_e2el_ms"] == pytest.approx(500.0)


def test_zero_duration_and_no_success() -> None:
    s = summarize([RequestResult(success=False, error="x")], duration=0.0)
    assert s["completed"] == 0 and s["failed"] == 1
    assert s["request_throughput"] == 0.0
    assert s["mean_ttft_ms"] is None and s["p99_e2el_ms"] is None
    table = format_table(s, errors=["x"])
    assert "n/a" in table and "Failed requests" in table and "x" in table


def test_table_and_per_request_lists() -> None:
    results = _results()
    s = summarize(results, duration=2.0)
    table = format_table(s)
    for label in (
        "Successful requests",
        "Mean TTFT (ms)",
        "P99 TPOT (ms)",
        "Median ITL (ms)",
        "Mean E2EL (ms)",
        "Output token throughput",
    ):
        assert label in table
    cols = per_request_lists(results)
    assert cols["success"] == [True, True, True, False]
    assert cols["ttft_ms"][:3] == pytest.approx([100.0, 300.0, 200.0])
    assert cols["ttft_ms"][3] is None and cols["error"][3] == "HTTP 500: boom"
    assert cols["output_tokens"] == [5, 3, 1, None]
    assert cols["itl_ms"][1] == pytest.approx([200.0, 200.0])
