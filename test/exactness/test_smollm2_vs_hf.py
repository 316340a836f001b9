"""SmolLM2-135M-Instruct: engine greedy output == HF transformers generate, token for token.

float32 on CPU; 12 chat prompts, 48 new tokens each; run as one batch, with
requests arriving mid-flight, and with a chunk size smaller than the prompts.
"""

import pytest
import torch

from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.engine import LocalEngine
from gyrfalcon.ipc.messages import SamplingParams

pytestmark = pytest.mark.slow

MAX_NEW = 48
QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 20.",
    "Translate 'good morning' into Spanish and German.",
    "Why is the sky blue?",
    "Give me a haiku about autumn leaves.",
    "What is 17 times 23? Show your work.",
    "Summarize the plot of Romeo and Juliet in one paragraph.",
    "How do I reverse a linked list? Answer briefly.",
    "Name the planets of the solar system in order from the sun.",
    "What are the health benefits of drinking water?",
]


@pytest.fixture(scope="module")
def chat_prompts(smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    out = []
    for q in QUESTIONS:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        out.append(tok.encode(text, add_special_tokens=False))
    return out


@pytest.fixture(scope="module")
def hf_outputs(smollm2_dir, chat_prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    outs = []
    for p in chat_prompts:
        ids = torch.tensor([p])
        g = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False
        )
        outs.append(g[0, len(p) :].tolist())
    return outs


def make_engine(model_dir, **kw):
    args = ServerArgs(model=model_dir, device="cpu", dtype="float32", **kw)
    return LocalEngine(args, model_dir)


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)


def test_hf_reference_is_sane(hf_outputs, smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert "Paris" in tok.decode(hf_outputs[0])


def test_one_batch_matches_hf(smollm2_dir, chat_prompts, hf_outputs):
    eng = make_engine(smollm2_dir, num_kv_pages=256)
    assert eng.generate(chat_prompts, GREEDY) == hf_outputs
    eng.check_integrity()
    assert eng.scheduler.num_free_pages == eng.scheduler.num_usable_pages


def test_mid_flight_arrivals_and_chunked_prefill_match_hf(smollm2_dir, chat_prompts, hf_outputs):
    assert max(len(p) for p in chat_prompts) > 16
    eng = make_engine(
        smollm2_dir, num_kv_pages=256, chunked_prefill_size=16, max_num_batched_tokens=24
    )
    got = {str(i): [] for i in range(len(chat_prompts))}
    pending = list(enumerate(chat_prompts))
    step = 0
    while pending or eng.has_work():
        if pending and step % 5 == 0:  # a new request every 5 steps
            i, p = pending.pop(0)
            eng.add(str(i), p, GREEDY)
        for out in eng.step():
            got[out.rid].extend(out.token_ids)
        step += 1
    assert [got[str(i)] for i in range(len(chat_prompts))] == hf_outputs
    eng.check_integrity()
    assert eng.scheduler.num_free_pages == eng.scheduler.num_usable_pages


def test_bf16_prompt_argmax_matches_hf_bf16_ties_included(smollm2_dir, chat_prompts, hf_outputs):
    """bfloat16 on CPU (the engine's torch ops are HF's): the top prompt logprob at every
    position is HF bf16's argmax. bf16 logits often tie at the top; HF (torch.argmax)
    takes the lowest id there, and so must the engine, in its top logprob as in greedy."""
    from transformers import AutoModelForCausalLM

    seqs = [p + o for p, o in zip(chat_prompts, hf_outputs)]
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.bfloat16).eval()
    eng = LocalEngine(
        ServerArgs(model=smollm2_dir, device="cpu", dtype="bfloat16", num_kv_pages=256),
        smollm2_dir,
    )
    ties = 0
    for i, seq in enumerate(seqs):
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, :-1]  # predicts seq[1:]
        top2 = logits.topk(2, dim=-1).values
        ties += int((top2[:, 0] == top2[:, 1]).sum())
        eng.add(str(i), seq, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
        plp = None
        while eng.has_work():
            for out in eng.step():
                plp = out.prompt_logprobs if out.prompt_logprobs is not None else plp
        assert plp is not None and len(plp) == len(seq)
        assert [pos.top[0].token_id for pos in plp[1:]] == logits.argmax(-1).tolist()
    assert ties >= 3  # the check above covered tied positions
    eng.check_integrity()
