"""Several worker ranks on the CPU: SmolLM2 split over 3 tensor-parallel processes
(gloo; 9 attention heads and 3 KV heads: tp 3 splits both, tp 2 does not divide
them), and 2 data-parallel groups behind 2 API servers (the frontends DP servers are
given at their token rates), answer greedy requests exactly like the one-rank server,
with nothing leaked; a dead rank takes the server down."""

import json
import os
import signal
import time

import pytest
from server_util import alive, children_of, start_server, stop_server, wait_drained, worker_pids

PROMPTS = ["Name three colors.", "What is 12 times 12?"]


def ranks_server(smollm2_dir, tmp_path_factory, name: str, *flags: str):
    root = tmp_path_factory.mktemp(name)
    srv = start_server(
        smollm2_dir, str(root / "server.log"), "--page-size", "16", "--cpu-threads", "1", *flags
    )
    yield srv
    assert stop_server(srv) == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def tp_server(smollm2_dir, tmp_path_factory):
    yield from ranks_server(
        smollm2_dir, tmp_path_factory, "tp-server", "--num-kv-pages", "256", "--tp-size", "3"
    )


@pytest.fixture(scope="module")
def dp_server(smollm2_dir, tmp_path_factory):
    yield from ranks_server(
        smollm2_dir, tmp_path_factory, "dp-server", "--num-kv-pages", "128", "--dp-size", "2",
        "--api-server-count", "2",
    )  # fmt: skip


def complete(base_url, prompt, **kw):
    from openai import OpenAI

    c = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)
    model = c.models.list().data[0].id
    messages = [{"role": "user", "content": prompt}]
    return c.chat.completions.create(model=model, messages=messages, temperature=0, **kw)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tp3_server_answers_like_one_rank(server, tp_server, prompt):
    one = complete(server.base_url, prompt, max_tokens=24, logprobs=True, top_logprobs=2)
    tp = complete(tp_server.base_url, prompt, max_tokens=24, logprobs=True, top_logprobs=2)
    a, b = one.choices[0], tp.choices[0]
    assert (b.message.content, b.finish_reason) == (a.message.content, a.finish_reason)
    for x, y in zip(a.logprobs.content, b.logprobs.content):
        assert y.token == x.token and y.logprob == pytest.approx(x.logprob, abs=1e-3)
    info = wait_drained(tp_server)
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info
    assert "3 worker rank(s)" in tp_server.log()


def test_structured_output_over_tp_and_dp_ranks_answers_like_one_rank(server, tp_server, dp_server):
    """Every TP rank keeps its own grammar matchers and masks in lockstep, each DP
    group its own requests': greedy answers under a schema equal one rank's."""
    schema = {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer"}},
        "required": ["color", "count"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}
    kw = dict(max_tokens=40, response_format=fmt)
    for prompt in PROMPTS:
        one = complete(server.base_url, prompt, **kw).choices[0].message.content
        for srv in (tp_server, dp_server):
            assert complete(srv.base_url, prompt, **kw).choices[0].message.content == one
        assert set(json.loads(one)) == {"color", "count"}
    for srv in (tp_server, dp_server):
        info = wait_drained(srv)
        assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info


def test_dp2_server_answers_like_one_rank(server, dp_server):
    """Four requests at once spread over both DP groups (the scheduler balances them)
    and both API servers (a connection each); each answer equals the one-rank server's;
    both groups' pages all come back, and every request's route to its API server."""
    from concurrent.futures import ThreadPoolExecutor

    prompts = PROMPTS + ["Say hello.", "Count to five."]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda p: complete(dp_server.base_url, p, max_tokens=16), prompts))
    for prompt, answer in zip(prompts, got):
        want = complete(server.base_url, prompt, max_tokens=16)
        assert answer.choices[0].message.content == want.choices[0].message.content
    info = wait_drained(dp_server)
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info
    assert info["num_total_pages"] == 2 * (128 - 1)  # NOTE: each group's pool, its dummy page aside
    assert "2 worker rank(s)" in dp_server.log() and "2 API servers on" in dp_server.log()


def test_a_dead_rank_takes_the_tp_server_down(smollm2_dir, tmp_path):
    """SIGKILL one rank of three (not the reporting one): the server exits non-zero
    within 30 s and no child is left (the other ranks do not hang in a collective)."""
    srv = start_server(
        smollm2_dir, str(tmp_path / "log"), "--num-kv-pages", "64", "--tp-size", "3",
        "--cpu-threads", "1",
    )  # fmt: skip
    kids = children_of(srv.proc.pid)
    workers = worker_pids(srv, 3)
    os.kill(workers[-1], signal.SIGKILL)  # NOTE: the last started: a rank that reports nothing
    try:
        code = srv.proc.wait(30)
    finally:
        stop_server(srv)
    assert code != 0 and "exited unexpectedly" in srv.log(), srv.log()[-3000:]
    time.sleep(0.5)
    assert not [k for k in kids if alive(k)]
