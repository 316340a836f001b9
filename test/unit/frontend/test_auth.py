"""--api-key: every route but /health and /version wants `Authorization: Bearer KEY`;
without it, or with another key, OpenAI's 401, and the engine never sees the request."""

from __future__ import annotations

import httpx
import pytest
from starlette.routing import Route

from gyrfalcon.frontend.auth import API_KEY_ENV, OPEN_PATHS, bearer_token, resolve_api_key

from .frontend_fakes import MODEL_NAME, USER, live_server, replying, run

KEY = "sk-test-0123456789"
BODIES = {
    "/v1/chat/completions": {"messages": USER, "max_tokens": 2},
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/tokenize": {"prompt": "hi"},
    "/v1/detokenize": {"tokens": [1, 2]},
}


def _routes(app) -> list[tuple[str, str]]:
    """(method, path) of every route the app serves, path parameters filled in."""
    out = []
    for route in app.routes:
        if not isinstance(route, Route) or route.path.startswith(("/docs", "/redoc")):
            continue
        path = route.path.replace("{model:path}", "some/model")
        out.extend((m, path) for m in sorted(route.methods or ()) if m != "HEAD")
    return out


def test_every_route_but_liveness_wants_the_key(tokenizer):
    async def body():
        async with live_server(tokenizer, replying(tokenizer), api_key=KEY) as srv:
            routes = _routes(srv.app)
            assert {p for _, p in routes if p.startswith("/v1/")} >= set(BODIES) | {"/v1/models"}
            async with httpx.AsyncClient(base_url=srv.url, timeout=10) as client:
                for method, path in routes:
                    kw = {"json": BODIES.get(path, {})} if method == "POST" else {}
                    for headers in ({}, {"Authorization": "Bearer wrong"},
                                    {"Authorization": f"Basic {KEY}"}):  # fmt: skip
                        r = await client.request(method, path, headers=headers, **kw)
                        if path in OPEN_PATHS:
                            assert r.status_code == 200, (method, path)
                            continue
                        assert r.status_code == 401, (method, path, headers, r.text)
                        err = r.json()["error"]
                        assert err["code"] == 401 and err["type"] == "AuthenticationError"
                        assert r.headers["www-authenticate"] == "Bearer"
                assert srv.scheduler.requests == [], "a refused request reached the engine"
                good = {"Authorization": f"Bearer {KEY}"}
                assert (await client.get("/v1/models", headers=good)).status_code == 200
                for path, payload in BODIES.items():
                    r = await client.post(path, json=payload, headers=good)
                    assert r.status_code == 200, (path, r.text)

    run(body)


def test_official_client_with_and_without_the_key(tokenizer):
    import openai

    async def body():
        async with live_server(tokenizer, replying(tokenizer), api_key=KEY) as srv:
            ok = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
            reply = await ok.chat.completions.create(model=MODEL_NAME, messages=USER, max_tokens=3)
            assert reply.choices[0].message.content
            stream = await ok.completions.create(
                model=MODEL_NAME, prompt="hi", max_tokens=3, stream=True
            )
            assert [c async for c in stream]
            bad = openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="nope", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await bad.chat.completions.create(model=MODEL_NAME, messages=USER)
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()

    run(body)


def test_key_from_flag_then_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_key(None) is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(None) == "from-env"
    assert resolve_api_key("from-flag") == "from-flag"
    for empty in ("", "  "):
        with pytest.raises(ValueError, match="empty"):
            resolve_api_key(empty)


def test_empty_key_is_refused_before_anything_loads(monkeypatch, capsys):
    from gyrfalcon.cli import main

    monkeypatch.setenv(API_KEY_ENV, "")
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--device", "cpu"])
    assert exc.value.code == 2 and "empty" in capsys.readouterr().err


def test_bearer_token_parsing():
    def scope(*headers):
        return {"headers": [(n.encode(), v.encode()) for n, v in headers]}

    assert bearer_token(scope(("authorization", f"Bearer {KEY}"))) == KEY
    assert bearer_token(scope(("authorization", f"bearer  {KEY} "))) == KEY
    assert bearer_token(scope(("authorization", f"Basic {KEY}"))) is None
    assert bearer_token(scope(("x-api-key", KEY))) is None
