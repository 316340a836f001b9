"""logit_bias, allowed_token_ids, min_tokens and prompt_logprobs on the real engine,
and the logprob entry of a stop token."""

from __future__ import annotations

import math

import pytest

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_logit_bias_forces_and_bans_tokens(client, model_name, tok):
    kw = dict(model=model_name, prompt=PROMPT, temperature=0, max_tokens=4, logprobs=0)
    plain = client.completions.create(**kw).choices[0]
    first = tok.encode(plain.text)[0]
    forced = tok.encode(" Berlin")[0]
    r = client.completions.create(**kw, logit_bias={str(forced): 100})
    assert r.choices[0].logprobs.tokens == [tok.decode([forced])] * 4  # +100 wins every step
    banned = client.completions.create(**kw, logit_bias={str(first): -100}).choices[0]
    assert banned.logprobs.tokens[0] != plain.logprobs.tokens[0]


def test_allowed_token_ids_bound_every_token(client, model_name, tok):
    allowed = tok.encode(" yes no maybe")
    r = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        temperature=1.0,
        seed=5,
        max_tokens=6,
        n=2,
        extra_body={"allowed_token_ids": allowed},
    )
    for choice in r.choices:
        assert set(tok.encode(choice.text)) <= set(allowed), choice.text


def test_min_tokens_outlasts_an_early_eos(client, model_name):
    kw = dict(model=model_name, messages=CHAT, temperature=0, max_tokens=64)
    natural = client.chat.completions.create(**kw)
    assert natural.choices[0].finish_reason == "stop"
    n = natural.usage.completion_tokens  # the EOS included
    longer = client.chat.completions.create(**kw, extra_body={"min_tokens": n + 3})
    assert longer.usage.completion_tokens >= n + 3
    # the same greedy text up to where the EOS was held back
    assert longer.choices[0].message.content.startswith(natural.choices[0].message.content)


def test_min_tokens_delays_stop_strings(client, model_name):
    kw = dict(model=model_name, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12, stop=[","])
    assert client.completions.create(**kw).choices[0].text == " 5"
    late = client.completions.create(**kw, extra_body={"min_tokens": 3}).choices[0]
    # the first 3 tokens (" 5", ",", " 6") are not searched; the next "," stops
    assert late.text == " 5, 6" and late.finish_reason == "stop"


def test_stop_token_keeps_its_logprob_entry(client, model_name, tok):
    r = client.chat.completions.create(
        model=model_name, messages=CHAT, temperature=0, max_tokens=64, logprobs=True
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    entries = choice.logprobs.content
    assert len(entries) == r.usage.completion_tokens
    assert entries[-1].token == tok.eos_token and tok.eos_token not in choice.message.content
    assert "".join(e.token for e in entries[:-1]) == choice.message.content


def test_prompt_logprobs_match_echo_logprobs(client, model_name, tok):
    r = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=1,
        temperature=0,
        echo=True,
        logprobs=1,
        extra_body={"prompt_logprobs": 2},
    )
    choice = r.choices[0]
    echo = choice.logprobs.token_logprobs
    vllm = choice.model_extra["prompt_logprobs"]
    ids = tok.encode(PROMPT)
    assert len(vllm) == len(ids) and vllm[0] is None
    for j in range(1, len(ids)):
        entry = vllm[j]
        actual = entry[str(ids[j])]
        assert math.isclose(actual["logprob"], echo[j], abs_tol=1e-6)
        assert actual["decoded_token"] == tok.decode([ids[j]])
        ranks = sorted(e["rank"] for k, e in entry.items() if k != str(ids[j]) or e["rank"] <= 2)
        assert ranks[:2] == [1, 2]
        top1 = next(e for e in entry.values() if e["rank"] == 1)
        assert actual["rank"] == 1 or actual["logprob"] <= top1["logprob"]
        assert len(entry) in (2, 3)  # the top 2, plus the prompt token when not among them
    chat = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=1, extra_body={"prompt_logprobs": 0}
    )
    prompt = chat.model_extra["prompt_logprobs"]
    assert prompt[0] is None and len(prompt) == chat.usage.prompt_tokens
    assert all(len(p) == 1 and next(iter(p.values()))["rank"] >= 1 for p in prompt[1:])
