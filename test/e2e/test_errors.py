"""Bad input gets OpenAI-shaped errors and the server keeps serving."""

import httpx
import openai
import pytest

MSG = [{"role": "user", "content": "hi"}]


def assert_error_shape(body: dict, status: int):
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"] and err["code"] == status


@pytest.mark.parametrize(
    "kw,param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_logprobs": 50, "logprobs": True}, "top_logprobs"),
    ],
)
def test_invalid_parameters_are_400(client, model_name, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=MSG, **kw)
    assert_error_shape(
        e.value.body if "error" in (e.value.body or {}) else {"error": e.value.body}, 400
    )


def test_empty_messages_is_400(client, model_name):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_name, messages=[])


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MSG)


def test_prompt_longer_than_context_is_400(client, model_name, server):
    ctx = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["max_model_len"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=[5] * (ctx + 1), max_tokens=1)
    assert "context" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model_name, prompt=[5] * 10, max_tokens=ctx)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_malformed_json_is_400(server, client, path):
    r = httpx.post(
        server.base_url + path, content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert_error_shape(r.json(), 400)


def test_wrong_types_are_400(server, client, model_name):
    for body in (
        {"model": model_name, "messages": "hello"},
        {"model": model_name, "messages": [{"role": "wizard", "content": "x"}]},
        {"model": model_name, "prompt": [[-1, 5]]},
        {"model": model_name, "prompt": {"a": 1}},
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(server.base_url + path, json=body)
        assert r.status_code == 400, (body, r.text)
        assert_error_shape(r.json(), 400)


def test_server_still_serves_after_errors(client, model_name):
    r = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=2)
    assert r.usage.completion_tokens >= 1
