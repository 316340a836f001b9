"""bench/device_timeline.py: graph launches told apart by correlation id, spans and end
deltas per launch, and the ops outside launches."""

from __future__ import annotations

import pytest

from gyrfalcon.bench.device_timeline import format_summary, short_name, split_by_launch, summarize


def _launch(corr: int, ts: float) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": ts, "dur": 5.0,
            "args": {"correlation": corr}}  # fmt: skip


def _op(name: str, ts: float, dur: float, corr: int, cat: str = "kernel") -> dict:
    return {
        "ph": "X",
        "cat": cat,
        "name": name,
        "ts": ts,
        "dur": dur,
        "args": {"correlation": corr},
    }


def _step(t0: float, corr: int, upload_corr: int, attn_us: float) -> list[dict]:
    """One decode step at t0: an upload outside the graph, then three graph kernels where
    the second starts early (programmatic dependent launch) and ends attn_us later."""
    return [
        _launch(corr, t0 - 50.0),
        _op("Memcpy HtoD (Pinned -> Device)", t0, 2.0, upload_corr, "gpu_memcpy"),
        _op("_norm_gemv_kernel", t0 + 5.0, 4.0, corr),
        _op("_decode_split_kernel", t0 + 7.0, 2.0 + attn_us, corr),  # ends at t0 + 9 + attn
        _op("void at::native::foo<int, 2>(float*)", t0 + 9.0 + attn_us, 3.0, corr),
    ]


def test_spans_and_end_deltas_per_launch() -> None:
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::copy_", "ts": 0.0, "dur": 1.0}]
    for i, attn in enumerate([100.0, 7.0, 7.0, 9.0]):
        events += _step(1000.0 * (i + 1), corr=10 * i + 1, upload_corr=10 * i + 2, attn_us=attn)
    launches, other = split_by_launch({"traceEvents": events})
    assert [len(ops) for ops in launches] == [3, 3, 3, 3]
    assert [op.name for op in other] == ["Memcpy HtoD (Pinned -> Device)"] * 4
    s = summarize(launches, other, skip=1)
    assert s["launches"] == 3 and s["ops_per_launch"] == 3
    # span: first start (t0 + 5) to last end (t0 + 12 + attn)
    assert s["span_us_median"] == pytest.approx(14.0) and s["span_us_min"] == pytest.approx(14.0)
    # attention ends attn + 9 - 9 = attn after the norm+GEMV; the last kernel 3 after it
    assert s["end_delta_us"]["_decode_split_kernel"] == pytest.approx((7 + 7 + 9) / 3)
    assert s["end_delta_us"]["at::native::foo"] == pytest.approx(3.0)
    assert list(s["end_delta_us"])[0] == "_decode_split_kernel"  # the largest first
    assert s["outside_ops_per_launch"] == pytest.approx(2 / 3)  # two of the kept steps' uploads
    text = format_summary(s)
    assert "span median 14.0 us" in text and "_decode_split_kernel" in text


def test_no_launch_left_is_an_error() -> None:
    launches, other = split_by_launch({"traceEvents": _step(0.0, 1, 2, 5.0)})
    with pytest.raises(AssertionError, match="none left"):
        summarize(launches, other, skip=2)


def test_short_names() -> None:
    assert (
        short_name("void at::native::k<128, 4, at::native::f<long>>(int, long)") == "at::native::k"
    )
    assert short_name("_skinny_gemm_kernel") == "_skinny_gemm_kernel"
    assert short_name("Memcpy DtoH (Device -> Pinned)") == "Memcpy DtoH (Device -> Pinned)"
