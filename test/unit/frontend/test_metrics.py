"""GET /metrics: Prometheus text that a scraper parses, counting what clients saw
(finished requests by reason, tokens, latency histograms) and what the scheduler
reports (running, waiting, KV use, preemptions, speculative acceptance)."""

from __future__ import annotations

import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gyrfalcon.frontend import serving_common
from gyrfalcon.frontend.metrics import MULTIPROC_DIR_ENV, ServingMetrics
from gyrfalcon.ipc.messages import RequestOutput, StatsReply

from .frontend_fakes import MODEL_NAME, REPLY, USER, live_server, post, replying, run


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(sample name, sorted labels) -> value, from exposition text (parsed strictly)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    key = (name, tuple(sorted({"model_name": MODEL_NAME, **labels}.items())))
    return samples(text)[key]


def test_metrics_count_what_clients_saw(tokenizer):
    reply_tokens = len(tokenizer.encode(REPLY)) + 1  # EOS counts as generated

    async def body():
        async with live_server(tokenizer, replying(tokenizer)) as srv:
            async with httpx.AsyncClient(base_url=srv.url, timeout=10) as client:
                empty = (await client.get("/metrics")).text
                assert value(empty, "gyrfalcon:num_requests_running") == 0
                r = await post(srv.url, "/v1/chat/completions", {"messages": USER, "n": 2})
                assert r.status_code == 200
                r = await post(srv.url, "/v1/completions", {"prompt": "x", "max_tokens": 3})
                assert r.json()["choices"][0]["finish_reason"] == "length"
                r = await post(srv.url, "/v1/chat/completions", {"messages": USER, "stream": True})
                assert r.status_code == 200
                m = await client.get("/metrics")
            assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
            text = m.text
            stop = value(text, "gyrfalcon:request_success_total", finished_reason="stop")
            length = value(text, "gyrfalcon:request_success_total", finished_reason="length")
            assert (stop, length) == (3, 1)  # n = 2 counts each choice
            generated = value(text, "gyrfalcon:generation_tokens_total")
            assert generated == 3 * reply_tokens + 3
            prompts = sum(len(req.prompt_ids) for req in srv.scheduler.requests)
            assert value(text, "gyrfalcon:prompt_tokens_total") == prompts
            for hist in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
                assert value(text, f"gyrfalcon:{hist}_count") == 4
            assert value(text, "gyrfalcon:time_per_output_token_seconds_count") == 4
            itl = value(text, "gyrfalcon:inter_token_latency_seconds_count")
            assert itl == generated - 4  # one token per output here: each gap after the first
            assert value(text, "gyrfalcon:kv_cache_usage_perc") == 0
            assert value(text, "gyrfalcon:num_preemptions_total") == 0

    run(body)


def test_request_timer_latencies_from_its_clock():
    m = ServingMetrics(MODEL_NAME)
    times = iter([0.0, 0.5, 0.7, 1.1, 1.2])  # arrival, outputs of 1, 2 and 1 tokens, finish
    timer = m.start()
    timer.clock = lambda: next(times)
    timer.arrival = timer.clock()
    timer.output(RequestOutput("r", [5], num_prompt_tokens=7))
    timer.output(RequestOutput("r", [6, 7]))  # a verify step emitting two tokens
    timer.output(RequestOutput("r", [8], finish_reason="stop"))
    timer.finish("stop")
    text = m.render(None).decode()
    assert value(text, "gyrfalcon:time_to_first_token_seconds_sum") == pytest.approx(0.5)
    assert value(text, "gyrfalcon:inter_token_latency_seconds_sum") == pytest.approx(0.6)
    assert value(text, "gyrfalcon:inter_token_latency_seconds_count") == 2
    # (last output - first output) / (tokens - 1) = 0.6 / 3
    assert value(text, "gyrfalcon:time_per_output_token_seconds_sum") == pytest.approx(0.2)
    assert value(text, "gyrfalcon:e2e_request_latency_seconds_sum") == pytest.approx(1.2)
    assert value(text, "gyrfalcon:prompt_tokens_total") == 7
    assert value(text, "gyrfalcon:generation_tokens_total") == 4
    assert "gyrfalcon:num_requests_running" not in text  # no engine figures without stats


def test_engine_figures_from_the_schedulers_stats():
    m = ServingMetrics(MODEL_NAME)
    stats = StatsReply(
        nonce=0, num_total_pages=200, num_free_pages=150, num_running=3, num_waiting=2,
        integrity_ok=True, num_preemptions=4, spec_verify_steps=10, spec_accepted=15,
    )  # fmt: skip
    text = m.render(stats).decode()
    assert value(text, "gyrfalcon:num_requests_running") == 3
    assert value(text, "gyrfalcon:num_requests_waiting") == 2
    assert value(text, "gyrfalcon:kv_cache_usage_perc") == 0.25
    assert value(text, "gyrfalcon:num_preemptions_total") == 4
    assert value(text, "gyrfalcon:spec_decode_num_verify_steps_total") == 10
    assert value(text, "gyrfalcon:spec_decode_num_accepted_tokens_total") == 15
    assert value(text, "gyrfalcon:spec_decode_mean_acceptance_length") == 2.5
    quiet = StatsReply(nonce=1, num_total_pages=200, num_free_pages=200, num_running=0,
                       num_waiting=0, integrity_ok=True)  # fmt: skip
    assert "spec_decode_mean_acceptance_length" not in m.render(quiet).decode()


def test_multiprocess_mode_sums_every_api_servers_requests(tmp_path, monkeypatch):
    """PROMETHEUS_MULTIPROC_DIR set (--api-server-count > 1): any API server's scrape
    counts the requests of all, its own once, beside its engine figures."""
    from prometheus_client import values

    monkeypatch.setenv(MULTIPROC_DIR_ENV, str(tmp_path))
    servers = []
    for pid, tokens in ((101, [5, 6]), (102, [7])):  # NOTE: two processes' value files
        monkeypatch.setattr(values, "ValueClass", values.MultiProcessValue(lambda p=pid: p))
        m = ServingMetrics(MODEL_NAME)
        timer = m.start()
        timer.output(RequestOutput("r", tokens, num_prompt_tokens=4, finish_reason="stop"))
        timer.finish("stop")
        servers.append(m)
    assert {f.name for f in tmp_path.iterdir()} >= {"counter_101.db", "counter_102.db"}
    stats = StatsReply(nonce=0, num_total_pages=10, num_free_pages=10, num_running=0,
                       num_waiting=0, integrity_ok=True)  # fmt: skip
    for m in servers:
        text = m.render(stats).decode()
        assert value(text, "gyrfalcon:request_success_total", finished_reason="stop") == 2
        assert value(text, "gyrfalcon:generation_tokens_total") == 3
        assert value(text, "gyrfalcon:prompt_tokens_total") == 8
        assert value(text, "gyrfalcon:e2e_request_latency_seconds_count") == 2
        assert value(text, "gyrfalcon:num_requests_running") == 0


@pytest.mark.parametrize("on", [False, True])
def test_log_requests_logs_arrival_and_end_never_text(tokenizer, caplog, monkeypatch, on):
    async def body():
        async with live_server(tokenizer, replying(tokenizer), log_requests=on) as srv:
            r = await post(srv.url, "/v1/completions", {"prompt": "secret words", "n": 2})
            assert r.status_code == 200

    # NOTE: a logger of its own: an earlier test's logging set-up may have disabled or
    # detached the module's (dictConfig disables the loggers that exist)
    monkeypatch.setattr(serving_common, "logger", logging.getLogger("test.serving_common"))
    with caplog.at_level(logging.INFO, logger="test.serving_common"):
        run(body)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("request ")]
    if not on:
        assert lines == []
        return
    arrivals = [line for line in lines if "prompt tokens" in line]
    ends = [line for line in lines if "TTFT" in line]
    assert len(arrivals) == len(ends) == 2  # one per choice
    assert all("max_tokens=16" in line for line in arrivals)
    n = len(tokenizer.encode(REPLY)) + 1  # EOS included
    assert all(f": stop, {n} tokens, TTFT " in line and "E2E" in line for line in ends)
    assert not any("secret" in line for line in lines)
