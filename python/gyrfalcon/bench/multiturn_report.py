"""bench_multiturn.py's figures: one request's record (`TurnResult`), the run's summary
(over successful requests, per turn index too), the JSON rows and the printed table."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gyrfalcon.bench.metrics import RequestResult, percentile


@dataclass
class TurnResult:
    """One request of a conversation: the bench client's figures and what this
    benchmark adds."""

    conversation: int
    turn: int  # 1-based
    prompt_len: int  # ids sent
    request: RequestResult = field(default_factory=RequestResult)
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens
    answer_texts: list[str] = field(default_factory=list)  # one per generated token
    answer_tokens_inexact: int = 0


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _cached_sum(results: Sequence[TurnResult]) -> int | None:
    """Cached prompt tokens of the results, None if none of them reported any."""
    reported = [r.cached_tokens for r in results if r.cached_tokens is not None]
    return sum(reported) if reported else None


def turn_row(turn: int, results: Sequence[TurnResult]) -> dict[str, Any]:
    """The figures of the successful requests of one turn index."""
    ttft = [r.request.ttft for r in results]
    prompt = sum(r.request.prompt_tokens for r in results)
    cached = _cached_sum(results)
    return {
        "turn": turn,
        "completed": len(results),
        "median_ttft_ms": _ms(percentile(ttft, 50.0)),
        "p90_ttft_ms": _ms(percentile(ttft, 90.0)),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_ratio": cached / prompt if cached is not None and prompt else None,
    }


def summarize_turns(
    results: Sequence[TurnResult], duration: float, turns: int, num_conversations: int
) -> dict[str, Any]:
    """The run's figures; token counts and latencies over successful requests."""
    ok = [r for r in results if r.request.success]
    output = sum(r.request.output_tokens for r in ok)
    prompt = sum(r.request.prompt_tokens for r in ok)
    cached = _cached_sum(ok)
    ttft = [r.request.ttft for r in ok]
    tpot = [t for r in ok if (t := r.request.tpot) is not None]
    finished = {r.conversation for r in ok if r.turn == turns}
    return {
        "conversations": num_conversations,
        "conversations_completed": len(finished),
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_output_tokens": output,
        "output_throughput": output / duration if duration > 0 else 0.0,
        "median_ttft_ms": _ms(percentile(ttft, 50.0)),
        "p90_ttft_ms": _ms(percentile(ttft, 90.0)),
        "median_tpot_ms": _ms(percentile(tpot, 50.0)),
        "median_e2el_ms": _ms(percentile([r.request.e2el for r in ok], 50.0)),
        "total_prompt_tokens": prompt,
        "total_cached_tokens": cached,
        "cached_ratio": cached / prompt if cached is not None and prompt else None,
        "answer_tokens_inexact": sum(r.answer_tokens_inexact for r in ok),
        "per_turn": [turn_row(k, [r for r in ok if r.turn == k]) for k in range(1, turns + 1)],
    }


def request_row(r: TurnResult, t0: float) -> dict[str, Any]:
    """One request in the JSON report (start_s: seconds after the run began)."""
    q = r.request
    return {
        "conversation": r.conversation,
        "turn": r.turn,
        "success": q.success,
        "error": q.error,
        "start_s": q.start_time - t0,
        "prompt_len": r.prompt_len,
        "prompt_tokens": q.prompt_tokens if q.success else None,
        "cached_tokens": r.cached_tokens,
        "output_tokens": q.output_tokens if q.success else None,
        "ttft_ms": _ms(q.ttft) if q.success else None,
        "tpot_ms": _ms(q.tpot),
        "e2el_ms": _ms(q.e2el) if q.success else None,
        "finish_reason": q.finish_reason,
        "answer_tokens_inexact": r.answer_tokens_inexact,
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "n/a"
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def format_report(summary: dict[str, Any], errors: Sequence[str] = (), width: int = 60) -> str:
    """The summary as a table, then one line per turn index."""

    def row(label: str, value: Any) -> str:
        return f"{label + ':':<{width - 14}}{_fmt(value):>14}"

    ratio = summary["cached_ratio"]
    lines = [" Multi-turn Benchmark Result ".center(width, "=")]
    lines += [
        row("Conversations completed", summary["conversations_completed"]),
        row("Successful requests", summary["completed"]),
        row("Failed requests", summary["failed"]),
        row("Benchmark duration (s)", summary["duration_s"]),
        row("Total generated tokens", summary["total_output_tokens"]),
        row("Output token throughput (tok/s)", summary["output_throughput"]),
        row("Median TTFT (ms)", summary["median_ttft_ms"]),
        row("P90 TTFT (ms)", summary["p90_ttft_ms"]),
        row("Median TPOT (ms)", summary["median_tpot_ms"]),
        row("Total prompt tokens", summary["total_prompt_tokens"]),
        row("Cached prompt tokens", summary["total_cached_tokens"]),
        row("Cached share of prompt tokens (%)", None if ratio is None else 100.0 * ratio),
        row("Answer tokens not exactly known", summary["answer_tokens_inexact"]),
        " Per turn ".center(width, "-"),
        f"{'turn':>4}{'requests':>10}{'med TTFT ms':>13}{'p90 TTFT ms':>13}{'cached %':>10}",
    ]
    for t in summary["per_turn"]:
        share = None if t["cached_ratio"] is None else 100.0 * t["cached_ratio"]
        lines.append(
            f"{t['turn']:>4}{t['completed']:>10}{_fmt(t['median_ttft_ms']):>13}"
            f"{_fmt(t['p90_ttft_ms']):>13}{_fmt(share):>10}"
        )
    if errors:
        lines.append(" Errors (distinct, first few) ".center(width, "-"))
        lines += [f"  {e[: width - 2]}" for e in errors]
    lines.append("=" * width)
    return "\n".join(lines)
