"""vLLM's tokenizer routes and GET /v1/models/{model} over a live server:
/tokenize in both shapes (the chat shape gives a chat completion's prompt ids),
token_strs, special tokens, /detokenize round trips, 404s and 400s."""

from __future__ import annotations

import httpx
import pytest

from .frontend_fakes import (
    MAX_MODEL_LEN,
    MODEL_NAME,
    REPLY,
    USER,
    WORD_BOS_ID,
    WORDS,
    live_server,
    post,
    replying,
    run,
    wait_until,
    word_tokenizer,
)

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Say hi."},
    {"role": "assistant", "content": "Sure, here"},
]


def _ids(words: str) -> list[int]:
    return [WORDS.index(w) for w in words.split()]


def test_tokenize_prompt_token_strs_and_aliases(tokenizer):
    async def body():
        async with live_server(tokenizer, replying(tokenizer)) as srv:
            r = await post(srv.url, "/tokenize", {"model": MODEL_NAME, "prompt": REPLY})
            assert r.status_code == 200, r.text
            ids = tokenizer.encode(REPLY)
            assert r.json() == {
                "count": len(ids),
                "max_model_len": MAX_MODEL_LEN,
                "tokens": ids,
                "token_strs": None,
            }
            r = await post(srv.url, "/v1/tokenize", {"prompt": REPLY, "return_token_strs": True})
            assert r.json()["tokens"] == ids
            assert r.json()["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
            assert "Ġworld" in r.json()["token_strs"]  # byte-level pieces, not decoded text
            assert srv.scheduler.requests == []  # the engine is never asked

    run(body)


def test_tokenize_chat_gives_the_chat_completions_prompt(tokenizer):
    async def body():
        async with live_server(tokenizer, replying(tokenizer)) as srv:
            r = await post(srv.url, "/v1/chat/completions", {"messages": USER})
            prompt_tokens = r.json()["usage"]["prompt_tokens"]
            sent = srv.scheduler.requests[0].prompt_ids
            for path in ("/tokenize", "/v1/tokenize"):
                r = await post(srv.url, path, {"model": MODEL_NAME, "messages": USER})
                assert r.status_code == 200, r.text
                data = r.json()
                assert data["tokens"] == sent and data["count"] == prompt_tokens

            # without the generation prompt: the conversation as it stands
            r = await post(srv.url, "/tokenize", {"messages": USER, "add_generation_prompt": False})
            text = tokenizer.apply_chat_template(USER, add_generation_prompt=False, tokenize=False)
            assert r.json()["tokens"] == tokenizer.encode(text, add_special_tokens=False)
            assert r.json()["tokens"] == sent[: r.json()["count"]]

            # the final message left open, for the model to continue
            r = await post(
                srv.url,
                "/tokenize",
                {"messages": CHAT, "add_generation_prompt": False, "continue_final_message": True},
            )
            assert r.status_code == 200, r.text
            text = tokenizer.decode(r.json()["tokens"])
            assert text.endswith("<|im_start|>assistant\nSure, here")
            assert text.count("<|im_end|>") == 2  # system and user messages only

    run(body)


def test_special_tokens_both_ways():
    tok = word_tokenizer()

    async def body():
        async with live_server(tok, replying(tok, "sure")) as srv:

            async def tokens(payload: dict) -> list[int]:
                r = await post(srv.url, "/tokenize", payload)
                assert r.status_code == 200, r.text
                return r.json()["tokens"]

            # a prompt gets the tokenizer's BOS by default (vLLM's default: true)
            assert await tokens({"prompt": "hi there"}) == [WORD_BOS_ID] + _ids("hi there")
            assert await tokens({"prompt": "hi there", "add_special_tokens": False}) == _ids(
                "hi there"
            )
            # a chat has what the template writes (default false), or a BOS on top
            messages = [{"role": "user", "content": "hi"}]
            rendered = [WORD_BOS_ID] + _ids("user hi </s> assistant")
            assert await tokens({"messages": messages}) == rendered
            assert (
                await tokens({"messages": messages, "add_special_tokens": True})
                == [WORD_BOS_ID] + rendered
            )
            r = await post(
                srv.url,
                "/tokenize",
                {
                    "messages": messages + [{"role": "assistant", "content": "sure here"}],
                    "add_generation_prompt": False,
                    "continue_final_message": True,
                    "return_token_strs": True,
                },
            )
            assert r.json()["token_strs"] == "<s> user hi </s> assistant sure here".split()

    run(body)


def test_detokenize_round_trips(tokenizer):
    async def body():
        async with live_server(tokenizer, replying(tokenizer)) as srv:
            ids = (await post(srv.url, "/tokenize", {"prompt": REPLY})).json()["tokens"]
            r = await post(srv.url, "/detokenize", {"model": MODEL_NAME, "tokens": ids})
            assert r.status_code == 200, r.text
            assert r.json() == {"prompt": REPLY}
            # special tokens are kept: a chat's ids give back the rendered template
            ids = (await post(srv.url, "/v1/tokenize", {"messages": USER})).json()["tokens"]
            r = await post(srv.url, "/v1/detokenize", {"tokens": ids})
            rendered = tokenizer.apply_chat_template(
                USER, add_generation_prompt=True, tokenize=False
            )
            assert r.json()["prompt"] == rendered
            assert (await post(srv.url, "/detokenize", {"tokens": []})).json() == {"prompt": ""}

    run(body)


def test_retrieve_model_with_a_slash_in_its_id(tokenizer):
    name = "HuggingFaceTB/SmolLM2-135M-Instruct"

    async def body():
        async with (
            live_server(tokenizer, replying(tokenizer), send_ready=False, model_name=name) as srv,
            httpx.AsyncClient(base_url=srv.url) as client,
        ):
            r = await client.get(f"/v1/models/{name}")
            assert r.status_code == 503 and r.json()["error"]["code"] == 503
            r = await post(srv.url, "/tokenize", {"prompt": "hi"})
            assert r.status_code == 503  # max_model_len is the engine's
            await srv.scheduler.ready()
            await wait_until(srv.engine.ready.is_set)
            r = await client.get(f"/v1/models/{name}")
            assert r.status_code == 200, r.text
            assert r.json() == (await client.get("/v1/models")).json()["data"][0]
            assert r.json()["id"] == name and r.json()["max_model_len"] == MAX_MODEL_LEN
            assert (await client.get("/v1/models/HuggingFaceTB")).status_code == 404

    run(body)


@pytest.mark.parametrize(
    "method,path,payload",
    [
        ("GET", f"/v1/models/{MODEL_NAME}x", None),
        ("GET", "/v1/models/org/other-model", None),
        ("POST", "/tokenize", {"model": "other", "prompt": "hi"}),
        ("POST", "/v1/tokenize", {"model": "other", "messages": USER}),
        ("POST", "/detokenize", {"model": "other", "tokens": [1]}),
        ("POST", "/v1/detokenize", {"model": "other", "tokens": [1]}),
    ],
)
def test_wrong_model_is_404(tokenizer, method, path, payload):
    async def body():
        async with (
            live_server(tokenizer, replying(tokenizer)) as srv,
            httpx.AsyncClient(base_url=srv.url) as client,
        ):
            r = await client.request(method, path, json=payload)
            assert r.status_code == 404, r.text
            err = r.json()["error"]
            assert (err["type"], err["param"], err["code"]) == ("NotFoundError", "model", 404)
            assert MODEL_NAME in err["message"]

    run(body)


@pytest.mark.parametrize(
    "path,payload,param",
    [
        ("/tokenize", "{not json", None),
        ("/tokenize", "[1, 2]", None),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"prompt": "hi", "return_token_strs": "maybe"}, "return_token_strs"),
        ("/tokenize", {"prompt": "hi", "messages": USER}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": "hi"}, "messages"),
        ("/tokenize", {"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
        (
            "/v1/tokenize",
            {"messages": USER, "continue_final_message": True},
            "continue_final_message",
        ),
        ("/detokenize", {}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
        ("/v1/detokenize", {"tokens": [-1]}, "tokens"),
        ("/v1/detokenize", {"tokens": [1.5]}, "tokens[0]"),
    ],
)
def test_bad_bodies_are_400(tokenizer, path, payload, param):
    async def body():
        async with live_server(tokenizer, replying(tokenizer)) as srv:
            r = await post(srv.url, path, payload)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert (err["type"], err["param"], err["code"]) == ("BadRequestError", param, 400)
            assert err["message"]

    run(body)


def test_openapi_documents_both_tokenize_shapes(tokenizer):
    """A client generated from /openapi.json learns both bodies of /tokenize (a prompt
    or chat messages), not a free-form object."""

    async def body():
        async with live_server(tokenizer, replying(tokenizer)) as srv:
            async with httpx.AsyncClient() as http:
                spec = (await http.get(f"{srv.url}/openapi.json")).json()
            for path in ("/tokenize", "/v1/tokenize"):
                schema = spec["paths"][path]["post"]["requestBody"]["content"]
                shapes = schema["application/json"]["schema"]["oneOf"]
                names = sorted(s["$ref"].rsplit("/", 1)[1] for s in shapes)
                assert names == ["TokenizeChatRequest", "TokenizeCompletionRequest"], shapes
            components = spec["components"]["schemas"]
            assert components["TokenizeCompletionRequest"]["required"] == ["prompt"]
            assert components["TokenizeChatRequest"]["required"] == ["messages"]

    run(body)
