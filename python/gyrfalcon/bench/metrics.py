"""Per-request measurements and the benchmark summary computed from them.

All times are recorded in seconds and reported in milliseconds. Definitions:

* TTFT: request sent -> first chunk carrying generated text.
* ITL: gaps between consecutive text-carrying chunks of one request.
* E2E latency: request sent -> stream finished.
* TPOT: ``(e2e - ttft) / (output_tokens - 1)``, only for requests that
  produced more than one token.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# Latency metrics in report order: (key, table label).
LATENCY_METRICS: tuple[tuple[str, str], ...] = (
    ("ttft", "Time to first token"),
    ("tpot", "Time per output token (excl. 1st)"),
    ("itl", "Inter-token latency"),
    ("e2el", "End-to-end latency"),
)


@dataclass
class RequestResult:
    """What one streamed request produced (filled in by the client)."""

    success: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    e2el: float = 0.0  # seconds
    start_time: float = 0.0  # perf_counter at send
    finish_reason: str | None = None
    cached_tokens: int | None = None  # prompt tokens the server found cached, if it says

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first, or None with <= 1 token."""
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.e2el - self.ttft) / (self.output_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation), or None when empty."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def mean(values: Sequence[float]) -> float | None:
    """Arithmetic mean, or None when empty."""
    return float(np.mean(values)) if len(values) else None


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


def _per_second(count: float, duration: float) -> float:
    return count / duration if duration > 0 else 0.0


def latency_samples(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Samples (seconds) of each latency metric over the successful requests."""
    ok = [r for r in results if r.success]
    return {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2el": [r.e2el for r in ok],
    }


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float] = (99.0,),
) -> dict[str, Any]:
    """Aggregate figures of a run that took ``duration`` seconds.

    Token counts and throughputs cover successful requests only. Latency
    keys are ``mean_<m>_ms``, ``median_<m>_ms`` and ``p<q>_<m>_ms`` for
    ``m`` in ttft, tpot, itl, e2el; they are None when there is no sample.
    """
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        # NOTE: prompts the server had computed before (an earlier run's, say) skip their
        # prefill: a figure with many is not a cold one
        "total_cached_input_tokens": _sum_reported(r.cached_tokens for r in ok),
        "request_throughput": _per_second(len(ok), duration),
        "input_throughput": _per_second(input_tokens, duration),
        "output_throughput": _per_second(output_tokens, duration),
        "total_token_throughput": _per_second(input_tokens + output_tokens, duration),
    }
    for name, samples in latency_samples(results).items():
        summary[f"mean_{name}_ms"] = _ms(mean(samples))
        summary[f"median_{name}_ms"] = _ms(percentile(samples, 50.0))
        for q in percentiles:
            summary[f"p{percentile_label(q)}_{name}_ms"] = _ms(percentile(samples, q))
    return summary


def _sum_reported(values: Iterable[int | None]) -> int | None:
    """The sum of the values given, or None when none is (a server that does not say)."""
    given = [v for v in values if v is not None]
    return sum(given) if given else None


def percentile_label(q: float) -> str:
    """``99.0 -> '99'``, ``99.9 -> '99.9'`` (the key fragment of a percentile)."""
    return str(int(q)) if float(q).is_integer() else str(q)


def per_request_lists(results: Sequence[RequestResult]) -> dict[str, list[Any]]:
    """Parallel per-request columns for the JSON report (None where failed)."""
    return {
        "success": [r.success for r in results],
        "error": [r.error for r in results],
        "input_tokens": [r.prompt_tokens if r.success else None for r in results],
        "output_tokens": [r.output_tokens if r.success else None for r in results],
        "ttft_ms": [r.ttft * 1000.0 if r.success else None for r in results],
        "e2el_ms": [r.e2el * 1000.0 if r.success else None for r in results],
        "itl_ms": [[g * 1000.0 for g in r.itl] if r.success else None for r in results],
        "finish_reason": [r.finish_reason for r in results],
        "cached_tokens": [r.cached_tokens if r.success else None for r in results],
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.2f}"
    return str(value)


def format_table(
    summary: dict[str, Any],
    percentiles: Sequence[float] = (99.0,),
    errors: Sequence[str] = (),
    width: int = 60,
) -> str:
    """Human-readable report of :func:`summarize` output (and a few errors)."""
    label_width = width - 14

    def row(label: str, value: Any) -> str:
        return f"{label + ':':<{label_width}}{_fmt(value):>14}"

    def title(text: str) -> str:
        return f" {text} ".center(width, "-")

    lines = [" Serving Benchmark Result ".center(width, "=")]
    lines += [
        row("Successful requests", summary["completed"]),
        row("Failed requests", summary["failed"]),
        row("Benchmark duration (s)", summary["duration_s"]),
        row("Total input tokens", summary["total_input_tokens"]),
        row("Total generated tokens", summary["total_output_tokens"]),
        row("Input tokens found cached", summary["total_cached_input_tokens"]),
        row("Request throughput (req/s)", summary["request_throughput"]),
        row("Input token throughput (tok/s)", summary["input_throughput"]),
        row("Output token throughput (tok/s)", summary["output_throughput"]),
        row("Total token throughput (tok/s)", summary["total_token_throughput"]),
    ]
    for name, label in LATENCY_METRICS:
        lines.append(title(label))
        upper = name.upper()
        lines.append(row(f"Mean {upper} (ms)", summary[f"mean_{name}_ms"]))
        lines.append(row(f"Median {upper} (ms)", summary[f"median_{name}_ms"]))
        for q in percentiles:
            tag = percentile_label(q)
            lines.append(row(f"P{tag} {upper} (ms)", summary[f"p{tag}_{name}_ms"]))
    if errors:
        lines.append(title("Errors (distinct, first few)"))
        lines += [f"  {e[: width - 2]}" for e in errors]
    lines.append("=" * width)
    return "\n".join(lines)
