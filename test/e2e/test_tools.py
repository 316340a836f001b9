"""Function calling, served: `--tool-call-parser hermes` reaches the frontend, and
SmolLM2 (greedy), shown two earlier turns that answered with a Hermes tool call,
answers the same question with one, which the openai client reads as a call,
streamed and not. A tool call's result then goes back through the real template."""

import json

import pytest
from server_util import start_server, stop_server, wait_drained

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# NOTE: two earlier turns answered with the call: the 135M model repeats it
FEW_SHOT = [QUESTION, {"role": "assistant", "content": CALL_TEXT}] * 2 + [QUESTION]


@pytest.fixture(scope="module")
def tool_server(smollm2_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("tools") / "server.log")
    srv = start_server(smollm2_dir, log, "--num-kv-pages", "256", "--tool-call-parser", "hermes")
    yield srv
    assert stop_server(srv) == 0, srv.log()[-3000:]


def test_a_real_model_output_becomes_a_tool_call(tool_server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{tool_server.base_url}/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=FEW_SHOT, tools=TOOLS, temperature=0, max_tokens=40)
    resp = client.chat.completions.create(**kw)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    names, args, finish = [], "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            assert not c.delta.content
            for part in c.delta.tool_calls or []:
                names += [part.function.name] if part.function.name else []
                args += part.function.arguments or ""
            finish = c.finish_reason or finish
    assert (names, json.loads(args), finish) == (["get_weather"], {"city": "Paris"}, "tool_calls")

    # the next turn: the call and its result go back through SmolLM2's template
    turn = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    result = {"role": "tool", "tool_call_id": call.id, "content": "22 C, sunny"}
    resp = client.chat.completions.create(
        model=model, messages=[QUESTION, turn, result], tools=TOOLS, max_tokens=8
    )
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")
    info = wait_drained(tool_server)
    assert info["integrity_ok"] and info["num_free_pages"] == info["num_total_pages"], info
