"""/v1/completions over a live server: prompt lists, echo, legacy logprobs."""

from __future__ import annotations

from gyrfalcon.ipc.messages import GenerateRequest

from .frontend_fakes import (
    PROMPT_LOGPROB,
    SAMPLED_LOGPROB,
    Script,
    live_server,
    post,
    replying,
    run,
    sse_events,
)


def test_completions_prompt_list_n_and_index(tokenizer):
    def by_prompt(req: GenerateRequest) -> Script:
        word = "first" if tokenizer.decode(req.prompt_ids).startswith("A") else "second"
        return Script(tokenizer.encode(f" {word} reply"))

    async def body():
        async with live_server(tokenizer, by_prompt) as srv:
            r = await post(
                srv.url, "/v1/completions", {"prompt": ["A one", "B two"], "n": 2, "seed": 5}
            )
            data = r.json()
            assert data["object"] == "text_completion"
            texts = [(c["index"], c["text"]) for c in data["choices"]]
            assert texts == [
                (0, " first reply"),
                (1, " first reply"),
                (2, " second reply"),
                (3, " second reply"),
            ]
            seeds = {q.rid.rsplit("-", 1)[1]: q.sampling.seed for q in srv.scheduler.requests}
            assert seeds == {"0": 5, "1": 6, "2": 5, "3": 6}
            assert all(q.sampling.max_tokens == 16 for q in srv.scheduler.requests)
            prompt_tokens = len(tokenizer.encode("A one")) + len(tokenizer.encode("B two"))
            assert data["usage"]["prompt_tokens"] == prompt_tokens

    run(body)


def test_completions_echo_with_logprobs(tokenizer):
    async def body():
        async with live_server(tokenizer, replying(tokenizer, " yes", finish="length")) as srv:
            prompt_ids = tokenizer.encode("Is it 世界?")
            r = await post(
                srv.url,
                "/v1/completions",
                {"prompt": prompt_ids, "echo": True, "logprobs": 1, "max_tokens": 5},
            )
            choice = r.json()["choices"][0]
            assert choice["text"] == "Is it 世界? yes"
            lp = choice["logprobs"]
            n = len(prompt_ids) + 1
            assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert lp["token_logprobs"][1:] == [PROMPT_LOGPROB] * (n - 2) + [SAMPLED_LOGPROB]
            assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
            assert srv.scheduler.requests[0].sampling.prompt_logprobs == 1

    run(body)


def test_completions_streaming_echo(tokenizer):
    async def body():
        async with live_server(tokenizer, replying(tokenizer, " and more")) as srv:
            r = await post(
                srv.url,
                "/v1/completions",
                {"prompt": "Start", "echo": True, "stream": True, "stop": "more"},
            )
            chunks = sse_events(r.text)
            assert chunks[0]["choices"][0]["text"].startswith("Start")
            assert "".join(c["choices"][0]["text"] for c in chunks) == "Start and "
            assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

    run(body)
