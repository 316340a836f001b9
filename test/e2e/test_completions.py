"""Text completions: prompt forms, echo, logprobs, streaming."""

import pytest

PROMPT = "The capital of France is"


def test_prompt_as_text_ids_and_lists(client, model_name, smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok.encode(PROMPT)
    kw = dict(model=model_name, temperature=0, max_tokens=8)
    by_text = client.completions.create(prompt=PROMPT, **kw)
    by_ids = client.completions.create(prompt=ids, **kw)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(ids)
    multi = client.completions.create(prompt=[PROMPT, "1, 2, 3,"], **kw)
    assert [c.index for c in multi.choices] == [0, 1]
    assert multi.choices[0].text == by_text.choices[0].text
    multi_ids = client.completions.create(prompt=[ids, tok.encode("1, 2, 3,")], **kw)
    assert [c.text for c in multi_ids.choices] == [c.text for c in multi.choices]


def test_echo_and_logprobs(client, model_name):
    r = client.completions.create(
        model=model_name, prompt=PROMPT, temperature=0, max_tokens=5, echo=True, logprobs=2
    )
    ch = r.choices[0]
    assert ch.text.startswith(PROMPT)
    lp = ch.logprobs
    n_prompt, n_out = r.usage.prompt_tokens, r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == n_prompt + n_out
    assert lp.token_logprobs[0] is None and all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == ch.text
    assert all(len(t) == 2 for t in lp.top_logprobs[n_prompt:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_streaming_equals_non_streaming(client, model_name):
    kw = dict(model=model_name, prompt=PROMPT, temperature=0, max_tokens=24)
    full = client.completions.create(**kw)
    chunks = list(
        client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_default_max_tokens_is_16(client, model_name):
    r = client.completions.create(
        model=model_name, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 16 and r.choices[0].finish_reason == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_across_tokens(client, model_name, stream):
    kw = dict(model=model_name, prompt="1, 2, 3, 4,", temperature=0, max_tokens=20)
    text = client.completions.create(**kw).choices[0].text
    assert " 6, 7" in text
    kw["stop"] = [" 6, 7"]  # spans several tokens
    if stream:
        got = "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True))
    else:
        got = client.completions.create(**kw).choices[0].text
    assert got == text[: text.index(" 6, 7")]
