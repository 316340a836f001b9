"""`GET /metrics`: Prometheus text format, with prometheus-client.

Two sources:
- per request, in the frontend as its outputs stream (`RequestTimer`): finished
  requests by finish reason, prompt and generation tokens, and the latency
  histograms TTFT (arrival to first token), ITL (gap between two outputs; one output
  may carry several tokens under speculative decoding), TPOT (a request's decode
  time per token after its first) and E2E (arrival to finish);
- on each scrape, one `StatsReply` from the scheduler (`EngineStats`, a collector):
  running and waiting requests, KV pages in use, preemptions and the speculative
  counters since start-up (verify steps, accepted drafts, and the acceptance length
  they give: tokens per verify step).

Names follow vLLM's (`vllm:` -> `gyrfalcon:`), each labelled with `model_name`. Every
app gets its own registry, so several apps in one process (tests) do not collide.

With several API servers (--api-server-count > 1) the launcher sets
PROMETHEUS_MULTIPROC_DIR before any of them imports prometheus-client: each process
then writes its request metrics to files there, and a scrape of any API server sums
every one's (prometheus-client's multiprocess mode), next to the engine's part.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from gyrfalcon.utils import MULTIPROC_DIR_ENV

if TYPE_CHECKING:
    from gyrfalcon.ipc.messages import RequestOutput, StatsReply

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "gyrfalcon:"
# seconds: from sub-millisecond decode gaps to minute-long requests
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3,
                   0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)  # fmt: skip


class ServingMetrics:
    """The registry of one app and its request-side metrics."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.engine = EngineStats(model_name)
        self.registry.register(self.engine)
        r, label = self.registry, ["model_name"]

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, label, registry=r, buckets=LATENCY_BUCKETS)

        reasons = [*label, "finished_reason"]
        self.finished = Counter(
            PREFIX + "request_success", "Requests finished", reasons, registry=r
        )
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens", label, registry=r)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Tokens generated", label, registry=r
        )
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first token")
        self.itl = hist("inter_token_latency_seconds", "Gap between two outputs of a request")
        self.tpot = hist("time_per_output_token_seconds", "Decode time per token after the first")
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish")
        # NOTE: the series of this model, bound once: `labels()` per streamed token (a
        # lock, a dict lookup, label checks) was ~3% of the frontend's time (cProfile)
        self.ttft_of = self.ttft.labels(model_name)
        self.itl_of = self.itl.labels(model_name)
        self.generation_tokens_of = self.generation_tokens.labels(model_name)
        self.exposed = self.registry
        if MULTIPROC_DIR_ENV in os.environ:
            # NOTE: the request metrics of every API server, this one's included, come
            # from the files; the local registry would count this one's twice. A value
            # kept in a file costs a streamed token ~1.8 us more (ITL and token count:
            # 2.7 us against 0.9 us, timeit on the CPU CI host), ~3% of its ~60 us
            self.exposed = CollectorRegistry()
            MultiProcessCollector(self.exposed)
            self.exposed.register(self.engine)

    def start(self) -> RequestTimer:
        """A timer for one request (one choice) arriving now."""
        return RequestTimer(self)

    def render(self, stats: StatsReply | None) -> bytes:
        """The exposition text, engine metrics from `stats` (None: left out)."""
        self.engine.latest = stats
        return generate_latest(self.exposed)


class RequestTimer:
    """One request's outputs as they arrive -> observations in its app's metrics."""

    def __init__(self, metrics: ServingMetrics, clock=time.monotonic):
        self.m, self.clock = metrics, clock
        self.arrival = clock()
        self.first: float | None = None
        self.last: float | None = None
        self.tokens = 0
        self.prompt_tokens = 0

    def output(self, out: RequestOutput) -> None:
        now = self.clock()
        if out.token_ids:
            if self.first is None:
                self.first = now
                self.m.ttft_of.observe(now - self.arrival)
            elif self.last is not None:
                self.m.itl_of.observe(now - self.last)
            self.last = now
            self.tokens += len(out.token_ids)
            self.m.generation_tokens_of.inc(len(out.token_ids))
        self.prompt_tokens = max(self.prompt_tokens, out.num_prompt_tokens)

    def summary(self, reason: str) -> str:
        """One line on the finished request (--log-requests)."""
        ttft = "no token" if self.first is None else f"TTFT {self.first - self.arrival:.3f} s"
        e2e = self.clock() - self.arrival
        return f"{reason}, {self.tokens} tokens, {ttft}, E2E {e2e:.3f} s"

    def finish(self, reason: str) -> None:
        """The request ended (`reason`: its finish reason, e.g. "stop", "length",
        "abort", "error")."""
        now, name = self.clock(), self.m.model_name
        self.m.finished.labels(name, reason).inc()
        self.m.prompt_tokens.labels(name).inc(self.prompt_tokens)
        self.m.e2e.labels(name).observe(now - self.arrival)
        if self.first is not None and self.last is not None and self.tokens > 1:
            self.m.tpot.labels(name).observe((self.last - self.first) / (self.tokens - 1))


class EngineStats(Collector):
    """The scheduler's figures of the latest scrape, as metrics."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.latest: StatsReply | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.latest
        if s is None:
            return
        label, value = ["model_name"], [self.model_name]

        def gauge(name: str, doc: str, v: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=label)
            g.add_metric(value, v)
            return g

        def counter(name: str, doc: str, v: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=label)
            c.add_metric(value, v)
            return c

        used = s.num_total_pages - s.num_free_pages
        yield gauge("num_requests_running", "Requests in the running batch", s.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "Fraction of KV pages in use (0-1)",
                    used / max(1, s.num_total_pages))  # fmt: skip
        yield counter("num_preemptions", "Requests preempted", s.num_preemptions)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                      s.prefix_cache_queries)  # fmt: skip
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache",
                      s.prefix_cache_hits)  # fmt: skip
        if s.prefix_cache_queries:
            yield gauge("prefix_cache_hit_rate", "Cached share of prompt tokens since start-up",
                        s.prefix_cache_hits / s.prefix_cache_queries)  # fmt: skip
        yield counter("spec_decode_num_verify_steps", "Rows that verified drafts",
                      s.spec_verify_steps)  # fmt: skip
        yield counter("spec_decode_num_accepted_tokens", "Drafts accepted", s.spec_accepted)
        if s.spec_verify_steps:
            mean = (s.spec_verify_steps + s.spec_accepted) / s.spec_verify_steps
            doc = "Tokens per verify step since start-up (accepted drafts + 1)"
            yield gauge("spec_decode_mean_acceptance_length", doc, mean)
