"""Chat completions through the official openai client against a live server."""

import pytest

MSG = [{"role": "user", "content": "What is the capital of France?"}]


def test_models_health_version(server, client, model_name):
    import httpx

    assert model_name == "SmolLM2-135M-Instruct" or model_name
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]


def test_greedy_chat_answers(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MSG, temperature=0, max_tokens=30)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == "stop"
    u = r.usage
    assert u.prompt_tokens > 10 and u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_streaming_equals_non_streaming_with_usage(client, model_name):
    kw = dict(model=model_name, messages=MSG, temperature=0, max_tokens=40)
    full = client.chat.completions.create(**kw)
    chunks = list(
        client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_max_tokens_and_max_completion_tokens_give_length(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MSG, temperature=0, max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    r = client.chat.completions.create(
        model=model_name, messages=MSG, temperature=0, max_completion_tokens=4, max_tokens=50
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4


def test_ignore_eos_runs_to_max_tokens(client, model_name):
    r = client.chat.completions.create(
        model=model_name,
        messages=MSG,
        temperature=0,
        max_tokens=40,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"


def test_stop_strings_are_trimmed(client, model_name):
    base = client.chat.completions.create(
        model=model_name, messages=MSG, temperature=0, max_tokens=30
    )
    text = base.choices[0].message.content
    assert "capital" in text
    for stream in (False, True):
        kw = dict(
            model=model_name, messages=MSG, temperature=0, max_tokens=30, stop=["apital", "zzz"]
        )
        if stream:
            chunks = list(client.chat.completions.create(**kw, stream=True))
            got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            r = client.chat.completions.create(**kw)
            got, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert got == text[: text.index("apital")]
        assert reason == "stop"


def test_stop_token_ids(client, model_name, smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    base = client.chat.completions.create(
        model=model_name, messages=MSG, temperature=0, max_tokens=12
    )
    ids = tok.encode(base.choices[0].message.content, add_special_tokens=False)
    assert tok.decode(ids) == base.choices[0].message.content and len(ids) >= 4
    stop_id = ids[3]
    assert stop_id not in ids[:3]
    r = client.chat.completions.create(
        model=model_name,
        messages=MSG,
        temperature=0,
        max_tokens=12,
        extra_body={"stop_token_ids": [stop_id]},
    )
    # the stop token counts as generated but is not rendered
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == 4
    assert r.choices[0].message.content == tok.decode(ids[:3])


def test_seed_reproducible_and_n(client, model_name):
    kw = dict(model=model_name, messages=MSG, temperature=1.0, max_tokens=20)
    a = client.chat.completions.create(**kw, seed=1234)
    b = client.chat.completions.create(**kw, seed=1234)
    c = client.chat.completions.create(**kw, seed=99)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.choices[0].message.content != c.choices[0].message.content
    r = client.chat.completions.create(**kw, n=3, seed=7)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert r.usage.prompt_tokens == a.usage.prompt_tokens  # counted once
    assert r.usage.completion_tokens <= 3 * 20 and r.usage.completion_tokens >= 3
    texts = {ch.message.content for ch in r.choices}
    assert len(texts) > 1


def test_chat_logprobs(client, model_name):
    r = client.chat.completions.create(
        model=model_name,
        messages=MSG,
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    # one entry per counted token: a final stop token (eos) is listed, not rendered
    assert len(content) == r.usage.completion_tokens
    stop_tok = 1 if r.choices[0].finish_reason == "stop" else 0
    for pos in content:
        assert len(pos.top_logprobs) == 3
        assert pos.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert pos.top_logprobs[0].logprob == pytest.approx(pos.logprob, abs=1e-4)
        assert pos.top_logprobs[0].logprob >= pos.top_logprobs[1].logprob
    rendered = content[: len(content) - stop_tok]
    assert "".join(p.token for p in rendered) == r.choices[0].message.content


@pytest.mark.parametrize("stream", [False, True])
def test_penalties_and_sampling_knobs_accepted(client, model_name, stream):
    r = client.chat.completions.create(
        model=model_name,
        messages=MSG,
        temperature=0.7,
        top_p=0.9,
        max_tokens=10,
        seed=3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        stream=stream,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2},
    )
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in r if c.choices)
    else:
        text = r.choices[0].message.content
    assert text


def test_streaming_with_n_choices(client, model_name):
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=MSG,
            temperature=0.8,
            seed=11,
            n=2,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = {0: "", 1: ""}
    finished = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished[ch.index] = ch.finish_reason
    assert set(finished) == {0, 1} and all(texts.values())
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens >= 2
    # the same request without streaming gives the same two texts (seed + i per choice)
    full = client.chat.completions.create(
        model=model_name, messages=MSG, temperature=0.8, seed=11, n=2, max_tokens=12
    )
    assert [full.choices[i].message.content for i in (0, 1)] == [texts[0], texts[1]]
