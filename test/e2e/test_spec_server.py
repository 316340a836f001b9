"""A server with EAGLE3 (SmolLM2 and a random drafter of its shape, static-buffer
graph replay, two DP groups: a request's group drafts while the other often runs an
idle step) answers greedy requests exactly like the plain one-rank server, stop
strings, n = 2 and logprobs included, and reports the spec usage fields."""

import pytest
from conftest import SMOLLM2_SHAPE, make_tiny_eagle3
from server_util import start_server, stop_server, wait_drained

PROMPTS = ["Name three colors.", "What is 12 times 12?", "Write a haiku about rain."]


@pytest.fixture(scope="module")
def spec_server(smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("spec-server")
    draft = str(root / "draft")
    make_tiny_eagle3(draft, **SMOLLM2_SHAPE)
    srv = start_server(
        smollm2_dir, str(root / "server.log"), "--num-kv-pages", "256", "--page-size", "16",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft,
        "--speculative-num-steps", "3", "--static-graph-replay", "--cuda-graph-bs", "1,2,4", "--cuda-graph-max-bs", "4",
        "--dp-size", "2",  # NOTE: EAGLE3 in two DP groups, one often idle
    )  # fmt: skip
    yield srv
    assert stop_server(srv) == 0, srv.log()[-3000:]


def chat(base_url, **kw):
    from openai import OpenAI

    c = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=300)
    model = c.models.list().data[0].id
    return c.chat.completions.create(model=model, temperature=0, **kw)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_spec_server_answers_like_the_plain_server(server, spec_server, prompt):
    body = dict(messages=[{"role": "user", "content": prompt}], max_tokens=24)
    plain = chat(server.base_url, **body, n=2, logprobs=True, top_logprobs=2)
    spec = chat(spec_server.base_url, **body, n=2, logprobs=True, top_logprobs=2)
    for p, s in zip(plain.choices, spec.choices):
        assert (s.message.content, s.finish_reason) == (p.message.content, p.finish_reason)
        for pe, se in zip(p.logprobs.content, s.logprobs.content):
            assert se.token == pe.token and se.logprob == pytest.approx(pe.logprob, abs=1e-3)
            assert [t.token for t in se.top_logprobs] == [t.token for t in pe.top_logprobs]
    assert spec.usage.completion_tokens == plain.usage.completion_tokens
    extra = spec.usage.model_extra
    assert extra["spec_verify_steps"] > 0 and extra["spec_accept_length"] >= 1.0
    assert "spec_accept_length" not in (plain.usage.model_extra or {})
    # a stop string inside the answer ends both at the same place
    words = p.message.content.split()
    stop = words[len(words) // 2]
    a = chat(server.base_url, **body, stop=[stop])
    b = chat(spec_server.base_url, **body, stop=[stop])
    assert (b.choices[0].message.content, b.usage.completion_tokens) == (
        a.choices[0].message.content,
        a.usage.completion_tokens,
    )
    info = wait_drained(spec_server)
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info


@pytest.fixture(scope="module")
def tp_spec_server(smollm2_dir, tmp_path_factory):
    """EAGLE3 over three tensor-parallel ranks (gloo): target and drafter split by
    heads (9 and 3 KV heads each), the drafter's LM head by its vocabulary."""
    root = tmp_path_factory.mktemp("tp-spec-server")
    draft = str(root / "draft")
    make_tiny_eagle3(draft, **SMOLLM2_SHAPE)
    srv = start_server(
        smollm2_dir, str(root / "server.log"), "--num-kv-pages", "256", "--page-size", "16",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", draft,
        "--speculative-num-steps", "2", "--static-graph-replay", "--cuda-graph-bs", "1,2,4",
        "--cuda-graph-max-bs", "4", "--tp-size", "3", "--cpu-threads", "1",
    )  # fmt: skip
    yield srv
    assert stop_server(srv) == 0, srv.log()[-3000:]


def test_spec_server_over_tp_ranks_answers_like_the_plain_server(server, tp_spec_server):
    body = dict(messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=24)
    plain = chat(server.base_url, **body, logprobs=True)
    spec = chat(tp_spec_server.base_url, **body, logprobs=True)
    p, s = plain.choices[0], spec.choices[0]
    assert (s.message.content, s.finish_reason) == (p.message.content, p.finish_reason)
    for pe, se in zip(p.logprobs.content, s.logprobs.content):
        assert se.token == pe.token and se.logprob == pytest.approx(pe.logprob, abs=1e-3)
    assert spec.usage.model_extra["spec_verify_steps"] > 0
    assert "3 worker rank(s)" in tp_spec_server.log()
    info = wait_drained(tp_spec_server)
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info
