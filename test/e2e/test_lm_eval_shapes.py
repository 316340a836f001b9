"""lm-evaluation-harness's `local-completions` traffic, replayed without lm-eval, against HF.

lm-eval scores a model behind an OpenAI-style server with `/v1/completions` alone.
The payloads below are the ones lm-eval 0.4.13 builds and the responses are parsed
the way it parses them (lm_eval/models/openai_completions.py `LocalCompletionsAPI`,
lm_eval/models/api_models.py `TemplateAPI`, lm_eval/api/model.py `TemplateLM`,
lm_eval/utils.py rolling windows), with its defaults: the HF tokenizer backend,
`tokenized_requests=True` (token-id prompts), `batch_size=1`, `seed=1234`. Every
score is compared with HF transformers on the same tokens (float32, CPU).
lm-eval itself is not imported: it is not a test dependency.
"""

from __future__ import annotations

import httpx
import pytest
import torch

pytestmark = pytest.mark.slow

TOL = 1e-4
SEED = 1234  # TemplateAPI(seed=1234): sent with every request
DEFAULT_MAX_LENGTH = 2048  # TemplateAPI(max_length=2048)
ROLLING_MAX_LENGTH = 24  # model_args max_length=24: windows of 22 tokens, several per document
MAX_GEN_TOKS = 24  # a task's generation_kwargs max_gen_toks
HF_MAX_NEW = 24  # the EOS cases' greedy replies are 8 tokens

PAIRS = [  # (context, continuation) as a multiple-choice task's requests carry them
    ("The capital of France is", " Paris"),
    ("The capital of France is", " Berlin"),
    ("1, 2, 3, 4,", " 5, 6, 7"),
    ("Water boils at ", "100 degrees Celsius."),  # trailing space moves to the continuation
    ("", "The quick brown fox jumps over the lazy dog."),  # empty context: the prefix token
]
# Chat questions whose greedy reply is short and ends in EOS; each reply is split
# into (context, continuation) so that the token after the continuation is EOS.
EOS_QUESTIONS = [
    "What is the capital of France? Answer in one word.",
    "What is 2 plus 2? Reply with just the number.",
]
DOCUMENTS = [  # loglikelihood_rolling documents (from docs/architecture.md)
    "A watchdog checks the children twice a second: if one dies, the server logs its "
    "exit code and exits non-zero. SIGINT and SIGTERM stop uvicorn, then the children "
    "are terminated; children also get SIGTERM from the kernel if the main process "
    "dies, so nothing is orphaned.",
    "Each step the policy decides how far each request advances: running decodes "
    "first (one token each), then unfinished prefills, then waiting requests in "
    "arrival order, within the step's token budget, the prefill budget, the limit on "
    "running requests and the free KV pages.",
]
FEW_SHOT = "Q: 2 + 3 = ?\nA: 5\n\nQ: 4 + 4 = ?\nA: 8\n\nQ: {} = ?\nA:"
GENERATE = [  # (context, until)
    (FEW_SHOT.format("1 + 6"), ["\n"]),
    (FEW_SHOT.format("9 + 9"), ["\n"]),
    ("The three primary colors are", ["."]),
]


# ---------------------------------------------------------------- lm-eval, mirrored


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """TemplateLM.loglikelihood + _encode_pair (causal) with TemplateAPI.tok_encode
    (HF backend, add_special_tokens=False): trailing spaces of the context move to
    the continuation; the whole text is encoded and split at the context's length;
    an empty context becomes the prefix token (BOS, else EOS)."""
    encode = lambda s: tok(s, add_special_tokens=False).input_ids
    if context == "":
        cont = encode(continuation)
        prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        return ([prefix], cont) if prefix != cont[0] else (cont[:1], cont[1:])
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    context_enc = encode(context)
    return context_enc, encode(context + continuation)[len(context_enc) :]


def loglikelihood_inputs(
    pairs: list[tuple[list[int], list[int]]], max_length: int = DEFAULT_MAX_LENGTH
) -> tuple[list[list[int]], list[int]]:
    """TemplateAPI.batch_loglikelihood_requests: left-truncate to max_length - 1."""
    limit = max_length - 1
    inputs, ctxlens = [], []
    for ctx, cont in pairs:
        inputs.append((ctx + cont)[-limit:])
        ctxlens.append(len(ctx) - max(0, len(ctx) + len(cont) - limit))
    return inputs, ctxlens


def loglikelihood_payload(model: str, inputs: list[list[int]]) -> dict:
    """LocalCompletionsAPI._create_payload(generate=False); TemplateAPI.create_message
    keeps the token-id lists (one per request at batch_size=1)."""
    return {
        "model": model,
        "prompt": inputs,
        "temperature": 0,
        "max_tokens": 1,
        "logprobs": 1,
        "seed": SEED,
        "echo": True,
    }


def generate_payload(model: str, inputs: list[list[int]], gen_kwargs: dict, eos: str) -> dict:
    """LocalCompletionsAPI._create_payload(generate=True); handle_stop_sequences adds
    the tokenizer's EOS text to `until` (TemplateAPI.model_call passes eos_string)."""
    kw = dict(gen_kwargs)
    kw.pop("do_sample", False)
    max_tokens = kw.pop("max_tokens") if "max_tokens" in kw else kw.pop("max_gen_toks", 256)
    stop = list(kw.pop("until", None) or [])
    if eos not in stop:
        stop.append(eos)
    return {
        "prompt": inputs,
        "model": model,
        "max_tokens": max_tokens,
        "temperature": kw.pop("temperature", 0),
        "stop": stop,
        "seed": SEED,
        **kw,
    }


def parse_logprobs(out: dict, ctxlens: list[int]) -> list[tuple[float, bool]]:
    """LocalCompletionsAPI.parse_logprobs: the last entry is taken to be the
    generated token, so [ctxlen:-1] is exactly the continuation."""
    res = []
    for choice, ctxlen in zip(sorted(out["choices"], key=lambda c: c["index"]), ctxlens):
        lps = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        is_greedy = all(lp == max(top.values()) for lp, top in zip(lps, tops))
        res.append((sum(lps), is_greedy))
    return res


def parse_generations(out: dict) -> list[str]:
    """LocalCompletionsAPI.parse_generations."""
    res = [None] * len(out["choices"])
    for c in out["choices"]:
        res[c["index"]] = c["text"]
    return res


def rolling_windows(
    tokens: list[int], prefix_token: int, max_length: int
) -> list[tuple[list[int], list[int]]]:
    """TemplateAPI.loglikelihood_rolling: utils.get_rolling_token_windows(max_seq_len=
    max_length - 2, context_len=1), each made disjoint by utils.make_disjoint_window."""
    max_seq_len = max_length - 2  # TemplateAPI keeps max_length - 1, then "- 1 for context"
    windows = []
    first = min(max_seq_len, len(tokens))
    windows.append(([prefix_token] + tokens[: first - 1], tokens[:first]))
    predicted = first
    while predicted < len(tokens):
        pred_len = min(len(tokens) - predicted, max_seq_len)
        end = predicted + pred_len
        windows.append((tokens[end - max_seq_len - 1 : end - 1], tokens[end - pred_len : end]))
        predicted += pred_len
    return [(a[: len(a) - (len(b) - 1)], b) for a, b in windows]


def postprocess(text: str, until: list[str]) -> str:
    """utils.postprocess_generated_text, as HFLM.generate_until applies it."""
    for term in until:
        if term:
            text = text.split(term)[0]
    return text


# ---------------------------------------------------------------- HF reference


@pytest.fixture(scope="module")
def hf(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return tok, model


def eos_ids(model) -> set[int]:
    ids = model.generation_config.eos_token_id
    return set(ids if isinstance(ids, list) else [ids])


@torch.no_grad()
def hf_score(model, ctx: list[int], cont: list[int]) -> tuple[float, bool, int]:
    """(sum of the continuation's logprobs, all greedy, argmax after the continuation).

    NOTE: float32 log_softmax, as HFLM._loglikelihood_tokens takes it: a float64 one
    differs from it by ~7e-6 per token, which over a document exceeds TOL.
    """
    logits = model(torch.tensor([ctx + cont])).logits[0]  # [T, V]
    lp = torch.log_softmax(logits[len(ctx) - 1 : -1], dim=-1)  # [len(cont), V]
    target = torch.tensor(cont)
    picked = lp.gather(-1, target[:, None])[:, 0]
    greedy = bool((lp.argmax(-1) == target).all())
    return float(picked.double().sum()), greedy, int(logits[-1].argmax())


@torch.no_grad()
def hf_greedy(model, tok, ids: list[int], max_new: int, stop: list[str] | None = None) -> list[int]:
    x = torch.tensor([ids])
    kw = dict(stop_strings=stop, tokenizer=tok) if stop else {}
    out = model.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=max_new, do_sample=False, **kw
    )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def eos_pairs(hf) -> list[tuple[str, str]]:
    """(context, continuation) text pairs whose greedy next token is EOS."""
    tok, model = hf
    pairs = []
    for q in EOS_QUESTIONS:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        reply = hf_greedy(model, tok, tok.encode(prompt, add_special_tokens=False), HF_MAX_NEW)
        assert reply[-1] in eos_ids(model) and len(reply) >= 4, (q, tok.decode(reply))
        reply = reply[:-1]
        for k in (len(reply) - 1, len(reply) // 2):  # a one-token and a longer continuation
            pairs.append((prompt + tok.decode(reply[:k]), tok.decode(reply[k:])))
    return pairs


# ---------------------------------------------------------------- the tests


def post(server, payload: dict) -> dict:
    r = httpx.post(f"{server.base_url}/v1/completions", json=payload, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def test_loglikelihood_matches_hf(server, model_name, hf, eos_pairs):
    tok, model = hf
    pairs = [encode_pair(tok, c, x) for c, x in PAIRS + eos_pairs]
    want = [hf_score(model, ctx, cont) for ctx, cont in pairs]
    # the EOS cases test what they claim: HF's greedy token after the continuation is EOS
    assert all(w[2] in eos_ids(model) for w in want[len(PAIRS) :]), want
    assert not any(w[2] in eos_ids(model) for w in want[: len(PAIRS)]), want

    inputs, ctxlens = loglikelihood_inputs(pairs)
    got, shapes = [], []
    for inp, ctxlen in zip(inputs, ctxlens):  # batch_size=1: one request per pair
        out = post(server, loglikelihood_payload(model_name, [inp]))
        got += parse_logprobs(out, [ctxlen])
        lp, finish = out["choices"][0]["logprobs"], out["choices"][0]["finish_reason"]
        counts = {len(lp[k]) - len(inp) for k in ("tokens", "token_logprobs", "top_logprobs")}
        shapes.append((counts, finish))
    table = "\n".join(
        f"{c[-24:]!r} + {x[:24]!r}: server {g} hf {w[:2]}"
        for (c, x), g, w in zip(PAIRS + eos_pairs, got, want)
    )
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], abs=TOL, rel=0), table
    assert [g[1] for g in got] == [w[1] for w in want], table
    assert any(w[1] for w in want) and not all(w[1] for w in want)  # both outcomes covered
    # one entry per counted token: the prompt (echo) and the generated token, EOS included
    assert shapes == [({1}, "length")] * len(PAIRS) + [({1}, "stop")] * len(eos_pairs), shapes

    # batch_size=N: one request, a list of token-id prompts, choices read by index
    batched = parse_logprobs(post(server, loglikelihood_payload(model_name, inputs)), ctxlens)
    assert [g[0] for g in batched] == pytest.approx([w[0] for w in want], abs=TOL, rel=0)
    assert [g[1] for g in batched] == [w[1] for w in want]


def test_loglikelihood_rolling_matches_hf(server, model_name, hf, eos_pairs):
    tok, model = hf
    prefix = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    eos_doc = "".join(eos_pairs[0])  # a chat exchange: its greedy next token is EOS
    for doc in [*DOCUMENTS, eos_doc]:
        tokens = tok(doc, add_special_tokens=False).input_ids
        windows = rolling_windows(tokens, prefix, ROLLING_MAX_LENGTH)
        assert len(windows) >= 2 and [t for _, b in windows for t in b] == tokens
        inputs, ctxlens = loglikelihood_inputs(windows, ROLLING_MAX_LENGTH)
        assert all(len(x) <= ROLLING_MAX_LENGTH - 1 for x in inputs)
        want = [hf_score(model, ctx, cont) for ctx, cont in windows]
        assert (want[-1][2] in eos_ids(model)) == (doc is eos_doc), doc
        got = []
        for inp, ctxlen in zip(inputs, ctxlens):  # each window its own request
            out = post(server, loglikelihood_payload(model_name, [inp]))
            got.append(parse_logprobs(out, [ctxlen])[0][0])
        assert sum(got) == pytest.approx(sum(w[0] for w in want), abs=TOL, rel=0), (
            doc[-40:],
            got,
            [w[0] for w in want],
        )


def test_generate_until_matches_hf(server, model_name, hf):
    tok, model = hf
    eos = tok.eos_token  # TemplateAPI.eos_string (HF backend)
    chat = tok.apply_chat_template(  # a reply that ends in EOS before any stop string
        [{"role": "user", "content": EOS_QUESTIONS[1]}], add_generation_prompt=True, tokenize=False
    )
    for context, until in [*GENERATE, (chat, ["\n\n"])]:
        gen_kwargs = {"until": until, "do_sample": False, "max_gen_toks": MAX_GEN_TOKS}
        ids = tok(context, add_special_tokens=False).input_ids  # tok_encode(add_bos_token=False)
        ids = ids[-(DEFAULT_MAX_LENGTH - 1 - MAX_GEN_TOKS) :]  # generate_until's left truncation
        payload = generate_payload(model_name, [ids], gen_kwargs, eos)
        assert payload["stop"] == [*until, eos] and payload["temperature"] == 0
        got = parse_generations(post(server, payload))[0]

        # HFLM.generate_until: greedy, stops at EOS or a stop string, decodes without
        # special tokens, cuts at the first stop string
        stop = [*until, eos]
        out = hf_greedy(model, tok, ids, MAX_GEN_TOKS, stop)
        raw = tok.decode(out, skip_special_tokens=True)
        # each case ends the way it claims: at a stop string, or at EOS for the chat one
        if context is chat:
            assert out[-1] in eos_ids(model) and not any(s in raw for s in until), raw
        else:
            assert any(s in raw for s in until), raw
        assert got == postprocess(raw, stop), (context, raw)
