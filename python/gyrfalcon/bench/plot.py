"""`gyrfalcon bench serve --plot FILE.png`: one figure of a serving run (matplotlib).

Four panels: the CDFs of TTFT, of TPOT and ITL, and of end-to-end latency over the
successful requests, then output throughput over the run (tokens per second in
`bins` intervals). A request's tokens are placed at its outputs' arrival times (its
first token at send + TTFT, each later output an ITL after the one before); an
output carrying several tokens (speculative decoding) shares them out evenly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gyrfalcon.bench.metrics import RequestResult


def token_times(results: Sequence[RequestResult]) -> tuple[np.ndarray, np.ndarray]:
    """(arrival time of each output of every successful request, relative to the first
    send; tokens it carried)."""
    ok = [r for r in results if r.success and r.output_tokens > 0]
    if not ok:
        return np.zeros(0), np.zeros(0)
    t0 = min(r.start_time for r in results)
    times: list[float] = []
    counts: list[float] = []
    for r in ok:
        arrivals = np.cumsum([r.start_time - t0 + r.ttft, *r.itl])
        times.extend(arrivals.tolist())
        counts.extend([r.output_tokens / len(arrivals)] * len(arrivals))
    return np.asarray(times), np.asarray(counts)


def throughput_series(
    results: Sequence[RequestResult], bins: int = 50
) -> tuple[np.ndarray, np.ndarray]:
    """(bin centres in seconds, output tokens/s in each bin); the bins tokens of all
    requests sum to their output tokens."""
    times, counts = token_times(results)
    if not len(times):
        return np.zeros(0), np.zeros(0)
    span = max(float(times.max()), 1e-9)
    sums, edges = np.histogram(times, bins=bins, range=(0.0, span), weights=counts)
    width = edges[1] - edges[0]
    return (edges[:-1] + edges[1:]) / 2, sums / width


def _cdf(ax, values: Sequence[float], label: str) -> None:
    v = np.sort(np.asarray(values, dtype=float))
    if len(v):
        ax.plot(v, np.arange(1, len(v) + 1) / len(v), label=label)


def plot_run(results: Sequence[RequestResult], path: str, title: str) -> None:
    """Write the figure of `results` to `path` (the format from its suffix)."""
    import matplotlib

    matplotlib.use("Agg")  # NOTE: no display on servers
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    ax = axes[0][0]
    _cdf(ax, [1e3 * r.ttft for r in ok], "TTFT")
    ax.set(xlabel="ms", ylabel="fraction of requests", title="time to first token")
    ax = axes[0][1]
    _cdf(ax, [1e3 * t for r in ok if (t := r.tpot) is not None], "TPOT (per request)")
    _cdf(ax, [1e3 * g for r in ok for g in r.itl], "ITL (per output)")
    ax.set(xlabel="ms", ylabel="fraction", title="time per output token")
    ax.legend()
    ax = axes[1][0]
    _cdf(ax, [r.e2el for r in ok], "E2E")
    ax.set(xlabel="s", ylabel="fraction of requests", title="end-to-end latency")
    ax = axes[1][1]
    centres, rate = throughput_series(results)
    ax.plot(centres, rate)
    ax.set(xlabel="s since the first request", ylabel="output tokens/s", title="throughput")
    for a in axes.flat:
        a.grid(alpha=0.3)
    fig.suptitle(f"{title}: {len(ok)} of {len(results)} requests succeeded")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
