"""Request validation (OpenAI ranges and shapes) and the SamplingParams mapping."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from gyrfalcon.frontend.protocol import (
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    TOP_K_DISABLED,
    ChatCompletionRequest,
    CompletionRequest,
    ParamError,
    to_sampling_params,
)
from gyrfalcon.ipc.messages import SamplingParams

USER = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **kw})


def completion(**kw: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "hi", **kw})


def error_locs(exc: ValidationError) -> list[tuple[Any, ...]]:
    return [tuple(e["loc"]) for e in exc.errors()]


def param_of(exc: ValidationError) -> str | None:
    cause = exc.errors()[0].get("ctx", {}).get("error")
    return cause.param if isinstance(cause, ParamError) else None


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("n", 0),
        ("n", MAX_N + 1),
        ("max_tokens", 0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("top_logprobs", MAX_TOP_LOGPROBS + 1),
        ("max_completion_tokens", 0),
        ("seed", 2**64),
        ("stop", 5),
        ("stop_token_ids", ["a"]),
    ],
)
def test_chat_rejects_out_of_range(field: str, value: Any):
    kw = {field: value}
    if field == "top_logprobs":
        kw["logprobs"] = True
    with pytest.raises(ValidationError) as info:
        chat(**kw)
    assert error_locs(info.value)[0][0] == field


def test_defaults_and_null_means_default():
    req = chat(temperature=None, n=None, top_p=None, stop=None, stop_token_ids=None)
    assert (req.temperature, req.n, req.top_p, req.stop_token_ids) == (1.0, 1, 1.0, [])
    assert req.stop_strings == [] and not req.stream and not req.include_usage


def test_messages_validation():
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": []})
    assert error_locs(info.value)[0] == ("messages",)
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({})
    with pytest.raises(ValidationError) as info:
        chat(messages=[{"role": "wizard", "content": "x"}])
    assert error_locs(info.value)[0][:3] == ("messages", 0, "role")
    with pytest.raises(ValidationError) as info:
        chat(messages=[{"role": "user", "content": None}])
    assert param_of(info.value) == "messages"
    with pytest.raises(ValidationError) as info:
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    assert param_of(info.value) == "messages"
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "user", "content": 5}])


def test_content_parts_and_roles():
    req = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        ]
    )
    assert [m.text for m in req.messages] == ["be brief", "a\nb", "", "42"]
    assert req.messages[3].to_template() == {
        "role": "tool",
        "content": "42",
        "tool_call_id": "call_1",
    }


def test_top_logprobs_requires_logprobs():
    with pytest.raises(ValidationError) as info:
        chat(top_logprobs=3)
    assert param_of(info.value) == "top_logprobs"
    assert chat(top_logprobs=3, logprobs=True).top_logprobs == 3
    assert chat(top_logprobs=0).top_logprobs == 0  # zero asks for nothing: accepted


def test_stream_options_require_stream():
    with pytest.raises(ValidationError) as info:
        chat(stream_options={"include_usage": True})
    assert param_of(info.value) == "stream_options"
    assert chat(stream=True, stream_options={"include_usage": True}).include_usage


def test_stop_forms():
    assert chat(stop="x").stop_strings == ["x"]
    assert chat(stop=["a", "", "b"]).stop_strings == ["a", "b"]
    with pytest.raises(ValidationError) as info:
        chat(stop=["s"] * (MAX_STOP_STRINGS + 1))
    assert param_of(info.value) == "stop"
    with pytest.raises(ValidationError) as info:
        chat(stop_token_ids=[-1])
    assert param_of(info.value) == "stop_token_ids"


def test_max_completion_tokens_overrides_max_tokens():
    assert chat(max_tokens=5).requested_max_tokens == 5
    assert chat(max_tokens=5, max_completion_tokens=9).requested_max_tokens == 9
    assert chat().requested_max_tokens is None


@pytest.mark.parametrize(
    "prompt,expected",
    [
        ("text", ["text"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_completion_prompt_forms(prompt: Any, expected: list[Any]):
    assert completion(prompt=prompt).prompts() == expected


@pytest.mark.parametrize(
    "prompt", [5, None, [1.5], ["a", 1], [[1], "a"], {"text": "x"}, [], [[]], [True], ["1", 2]]
)
def test_completion_rejects_bad_prompts(prompt: Any):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": prompt})


def test_completion_fields():
    with pytest.raises(ValidationError) as info:
        completion(suffix="after")
    assert param_of(info.value) == "suffix"
    assert completion(suffix="").suffix == ""
    with pytest.raises(ValidationError):
        completion(logprobs=MAX_TOP_LOGPROBS + 1)
    with pytest.raises(ValidationError):
        completion(logprobs=-1)
    assert completion(echo=True, logprobs=2).echo


def test_unknown_fields_are_ignored_and_named():
    req = chat(
        frobnicate=True,
        tools=None,
        messages=[{"role": "user", "content": "hi", "mood": "x"}],
        stream=True,
        stream_options={"include_usage": True, "shiny": 1},
    )
    assert req.n == 1
    # named for the log line, nested ones by path; inactive refused fields are not unknown
    assert sorted(req.unknown_fields()) == [
        "frobnicate",
        "messages[0].mood",
        "stream_options.shiny",
    ]
    assert chat(user="u", metadata={"k": "v"}, store=False).unknown_fields() == []


@pytest.mark.parametrize(
    "field,value",
    [
        ("functions", [{"name": "f"}]),
        ("function_call", "auto"),
        ("use_beam_search", True),
        ("modalities", ["text", "audio"]),
        ("prediction", {"type": "content", "content": "x"}),
    ],
)
def test_fields_not_built_yet_are_refused_by_name(field: str, value: Any):
    for make in (chat, completion):
        with pytest.raises(ValidationError) as info:
            make(**{field: value})
        assert param_of(info.value) == field
        assert field in str(info.value)


@pytest.mark.parametrize(
    "field,value",
    [
        ("response_format", {"type": "text"}),
        ("tools", []),
        ("tool_choice", "none"),
        ("use_beam_search", False),
        ("modalities", ["text"]),
        ("regex", None),
    ],
)
def test_refused_fields_with_values_that_change_nothing_are_accepted(field: str, value: Any):
    assert chat(**{field: value}).n == 1


@pytest.mark.parametrize(
    "field,value",
    [
        ("tools", [{"type": "function", "function": {"name": "f"}}]),
        ("tool_choice", "auto"),
        ("tool_choice", {"type": "function", "function": {"name": "f"}}),
    ],
)
def test_tools_are_refused_by_text_completions(field: str, value: Any):
    with pytest.raises(ValidationError) as info:
        completion(**{field: value})
    assert param_of(info.value) == field
    assert "/v1/chat/completions" in str(info.value)


def test_tool_calls_only_in_assistant_messages():
    calls = [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    req = chat(messages=[*USER, {"role": "assistant", "content": None, "tool_calls": calls}])
    assert req.messages[1].to_template()["tool_calls"] == [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": {}}}
    ]
    with pytest.raises(ValidationError) as info:
        chat(messages=[{"role": "user", "content": "hi", "tool_calls": calls}])
    assert param_of(info.value) == "messages"


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", "8"),
        ("max_tokens", True),
        ("max_tokens", 8.0),
        ("n", True),
        ("temperature", "0.5"),
        ("temperature", False),
        ("top_p", "1"),
        ("seed", "7"),
        ("stream", "true"),
        ("stream", 1),
        ("logprobs", 1),
        ("top_k", 5.5),
        ("stop_token_ids", [True]),
        ("ignore_eos", "yes"),
        ("logit_bias", {"5": "1"}),
        ("min_tokens", "2"),
    ],
)
def test_wrong_types_are_rejected(field: str, value: Any):
    with pytest.raises(ValidationError) as info:
        chat(**{field: value})
    assert error_locs(info.value)[0][0] == field


def test_numbers_keep_their_json_forms():
    req = chat(temperature=1, top_p=1, max_tokens=8, seed=-3)  # an int is a valid float
    assert (req.temperature, req.top_p, req.max_tokens, req.seed) == (1.0, 1.0, 8, -3)
    with pytest.raises(ValidationError) as info:
        completion(logprobs=True)
    assert error_locs(info.value)[0][0] == "logprobs"


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
            "messages[0].content[0].text",
        ),
        ({"messages": USER, "stop": ["ok", "\ud83d"]}, "stop[1]"),
    ],
)
def test_lone_surrogates_are_rejected_by_path(body: dict[str, Any], param: str):
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(body)
    assert param_of(info.value) == param
    with pytest.raises(ValidationError) as info:
        completion(prompt="x\ud800")
    assert param_of(info.value) == "prompt"


def test_stop_strings_are_bounded():
    assert chat(stop=["x" * MAX_STOP_STRING_CHARS]).stop_strings
    with pytest.raises(ValidationError) as info:
        chat(stop="x" * (MAX_STOP_STRING_CHARS + 1))
    assert param_of(info.value) == "stop"


def test_logit_bias_validation():
    assert chat(logit_bias={"5": 1.5, "7": -100}).bias_by_id == {5: 1.5, 7: -100.0}
    for bad in ({"x": 1.0}, {"5": 100.5}, {"5": -101}, {"": 1.0}):
        with pytest.raises(ValidationError) as info:
            chat(logit_bias=bad)
        assert param_of(info.value) == "logit_bias"


def test_new_sampling_fields_validation():
    with pytest.raises(ValidationError) as info:
        chat(allowed_token_ids=[])
    assert param_of(info.value) == "allowed_token_ids"
    with pytest.raises(ValidationError) as info:
        chat(min_tokens=5, max_tokens=4)
    assert param_of(info.value) == "min_tokens"
    assert chat(min_tokens=4, max_tokens=4).min_tokens == 4
    with pytest.raises(ValidationError) as info:
        chat(prompt_logprobs=2, stream=True)
    assert param_of(info.value) == "prompt_logprobs"
    with pytest.raises(ValidationError):
        chat(prompt_logprobs=MAX_TOP_LOGPROBS + 1)
    with pytest.raises(ValidationError) as info:
        completion(best_of=3, n=2)
    assert param_of(info.value) == "best_of"
    assert completion(best_of=2, n=2).n == 2
    req = chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert req.continuous_usage
    req = chat(stream=True, stream_options={"continuous_usage_stats": True})
    assert not req.continuous_usage  # vLLM: only together with include_usage


def test_new_fields_reach_the_engine():
    sp = to_sampling_params(
        chat(min_tokens=2, logit_bias={"9": 3.0}, allowed_token_ids=[9, 10], prompt_logprobs=1),
        8,
    )
    assert (sp.min_tokens, sp.logit_bias, sp.allowed_token_ids) == (2, {9: 3.0}, [9, 10])
    assert sp.prompt_logprobs == 1 and sp.adjusts_logits
    sp = to_sampling_params(completion(echo=True, logprobs=2, prompt_logprobs=4), 8)
    assert sp.prompt_logprobs == 4  # the larger of the two asks


def test_to_sampling_params_chat_mapping():
    req = chat(
        temperature=0.3,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=7,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        stop_token_ids=[5, 6],
        ignore_eos=True,
        logprobs=True,
        top_logprobs=4,
    )
    sp = to_sampling_params(req, max_tokens=33)
    assert sp == SamplingParams(
        temperature=0.3,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        seed=7,
        repetition_penalty=1.1,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        max_tokens=33,
        stop_token_ids=[5, 6],
        ignore_eos=True,
        logprobs=4,
        prompt_logprobs=None,
    )


def test_to_sampling_params_logprob_conventions():
    assert to_sampling_params(chat(), 1).logprobs is None
    assert to_sampling_params(chat(logprobs=True), 1).logprobs == 0
    assert to_sampling_params(chat(top_k=0), 1).top_k == TOP_K_DISABLED
    assert to_sampling_params(chat(temperature=0), 1).greedy
    sp = to_sampling_params(completion(logprobs=3), 8)
    assert (sp.logprobs, sp.prompt_logprobs, sp.max_tokens) == (3, None, 8)
    sp = to_sampling_params(completion(logprobs=2, echo=True), 8)
    assert (sp.logprobs, sp.prompt_logprobs) == (2, 2)
    sp = to_sampling_params(completion(echo=True), 8)
    assert (sp.logprobs, sp.prompt_logprobs) == (None, None)
