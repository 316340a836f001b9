"""SmolLM2 on the GPU: float32 exact vs HF (triton, torch_ref); bf16 flashinfer teacher-forced
argmax agrees with HF bf16 at >= 99% of >= 2000 positions (those where HF bf16 has no tie
at the top)."""

import pytest
import torch

from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.engine import LocalEngine
from gyrfalcon.ipc.messages import SamplingParams

pytestmark = pytest.mark.gpu

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that returns the square of a number.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 20.",
    "Why is the sky blue?",
    "Give me a haiku about autumn leaves.",
    "What is 17 times 23? Show your work.",
    "Name the planets of the solar system in order from the sun.",
]
# For the teacher-forced check: more everyday questions, so that the natural
# answers (up to EOS) cover >= 2000 positions.
MORE_QUESTIONS = QUESTIONS + [
    "How do airplanes stay in the air?",
    "Describe a healthy breakfast.",
    "What causes the seasons on Earth?",
    "Write a short poem about the sea.",
    "How does a refrigerator work?",
    "Give three tips for learning a new language.",
    "What is the difference between weather and climate?",
    "Explain what a computer virus is.",
    "Why do cats purr?",
    "How can I improve my sleep?",
    "What is the water cycle?",
    "Summarize the story of Cinderella.",
    "What are the benefits of regular exercise?",
    "How do vaccines work?",
    "Write a thank-you note to a teacher.",
    "What is machine learning, in simple terms?",
    "How do bees make honey?",
    "Explain gravity to a child.",
    "What should I pack for a weekend camping trip?",
    "Why is reading important?",
]


def chat_prompts(model_dir, questions):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [
        tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for q in questions
    ]


@pytest.fixture(scope="module")
def prompts(smollm2_gpu_dir):
    return chat_prompts(smollm2_gpu_dir, QUESTIONS)


def hf_model(d, dtype, attn_implementation=None):
    from transformers import AutoModelForCausalLM

    kw = {"attn_implementation": attn_implementation} if attn_implementation else {}
    return AutoModelForCausalLM.from_pretrained(d, dtype=dtype, **kw).cuda().eval()


@pytest.fixture(scope="module")
def hf_float32_outputs(smollm2_gpu_dir, prompts):
    m = hf_model(smollm2_gpu_dir, torch.float32)
    ref = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        g = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False)
        ref.append(g[0, len(p) :].tolist())
    return ref


@pytest.mark.parametrize("backend", ["triton", "torch_ref"])
def test_float32_token_identical_to_hf(smollm2_gpu_dir, prompts, hf_float32_outputs, backend):
    args = ServerArgs(
        model=smollm2_gpu_dir, device="cuda", dtype="float32", attention_backend=backend,
        decode_attention_backend=backend, num_kv_pages=2048,
    )  # fmt: skip
    eng = LocalEngine(args, smollm2_gpu_dir)
    got = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=48))
    assert got == hf_float32_outputs


def engine_argmax(eng, seq, n_prompt, rid):
    """The engine's argmax for every position after the prompt, read through prompt logprobs."""
    eng.add(rid, seq, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    plp = None
    while eng.has_work():
        for out in eng.step():
            if out.prompt_logprobs is not None:
                plp = out.prompt_logprobs
    eng.step()
    return [pos.top[0].token_id for pos in plp[n_prompt:]]


def agreement(a, b, keep=None):
    """(share of positions where the argmaxes a and b agree, positions counted); `keep`
    (per position bools, shaped like a) limits the count to some positions."""
    keep = keep or [[True] * len(u) for u in a]
    pairs = [(x, y) for u, v, w in zip(a, b, keep) for x, y, k in zip(u, v, w) if k]
    return sum(int(x == y) for x, y in pairs) / len(pairs), len(pairs)


def test_bf16_flashinfer_teacher_forced_argmax(smollm2_gpu_dir):
    """On the same answers (greedy, up to EOS; >= 2000 positions), the per-position
    argmax of the engine (bf16, flashinfer) must agree with HF bf16 at >= 99% of the
    positions where HF bf16's two largest logits differ, at >= 98% of all, as well as
    HF bf16 with its eager attention does, and with HF float32 as well as HF bf16 does
    (each within 0.5 points). Printed for scale: every backend.

    NOTE: bf16 logits tie at the top often: HF bf16's two largest logits are equal at
    ~2.5% of these positions, and there HF's argmax takes the lower id. Any last-bit
    difference in the hidden state (other GEMM kernels, another attention kernel)
    decides about half of those the other way, so 99% of *all* positions is below the
    bf16 noise floor (HF bf16 itself agrees with HF float32 at ~98.3%, and HF bf16
    with its eager attention agrees with HF bf16's default SDPA at 98.60% of 5292
    positions on nvidia-h100-x1: results/gpu_tests_nvidia-h100-x1.json). On the CPU,
    where the engine's torch ops are HF's, it agrees with HF bf16 at every one of 4973
    positions, ties included (the engine's top logprob takes the lowest id among
    equals, as torch.argmax does).

    Also an fp8 (e4m3) KV cache on triton: it must stay within 3 points of HF bf16's
    own agreement with HF float32. Measured on nvidia-h100-x1: 1.85 points below it
    over 4923 positions (7a6dd56) and 2.29 over 5292 (89d0820: the answers are the
    engine's own bf16 greedy ones, and they changed between the two commits); a
    broken fp8 path falls far below."""
    prompts = chat_prompts(smollm2_gpu_dir, MORE_QUESTIONS)

    def make(backend, dtype="bfloat16", kv_cache_dtype="auto"):
        args = ServerArgs(
            model=smollm2_gpu_dir, device="cuda", dtype=dtype, attention_backend=backend,
            decode_attention_backend=backend, num_kv_pages=2048, kv_cache_dtype=kv_cache_dtype,
        )  # fmt: skip
        return LocalEngine(args, smollm2_gpu_dir)

    fi = make("flashinfer")
    outs = fi.generate(prompts, SamplingParams(temperature=0, max_tokens=256))
    seqs = [p + o for p, o in zip(prompts, outs)]

    def hf_argmax(dtype, attn_implementation=None):
        """(argmax per position, whether its two largest logits are equal)"""
        m = hf_model(smollm2_gpu_dir, dtype, attn_implementation)
        res, ties = [], []
        for p, seq in zip(prompts, seqs):
            with torch.no_grad():
                logits = m(torch.tensor([seq], device="cuda")).logits[0, len(p) - 1 : -1]
            res.append(logits.argmax(-1).tolist())  # tokens len(p)..end
            top2 = logits.topk(2, dim=-1).values
            ties.append((top2[:, 0] == top2[:, 1]).tolist())
        return res, ties

    (hf16, ties16), (hf32, _) = hf_argmax(torch.bfloat16), hf_argmax(torch.float32)
    hf16_eager, _ = hf_argmax(torch.bfloat16, "eager")  # HF with another attention kernel
    untied = [[not t for t in u] for u in ties16]
    ours = {
        name: [engine_argmax(eng, s, len(p), f"{name}{i}") for i, (p, s) in
               enumerate(zip(prompts, seqs))]
        for name, eng in (("flashinfer", fi), ("triton", make("triton")),
                          ("torch_ref", make("torch_ref")),
                          ("triton_fp8kv", make("triton", kv_cache_dtype="fp8_e4m3")))
    }  # fmt: skip
    report = {
        "hf_bf16_top_ties": sum(map(sum, ties16)),
        "hf_bf16_vs_hf_fp32": agreement(hf16, hf32),
        "hf_bf16_eager_attention_vs_hf_bf16": agreement(hf16_eager, hf16),
        "hf_bf16_eager_attention_vs_hf_bf16_untied": agreement(hf16_eager, hf16, untied),
    }
    for name, res in ours.items():
        report[f"{name}_bf16_vs_hf_bf16"] = agreement(res, hf16)
        report[f"{name}_bf16_vs_hf_bf16_untied"] = agreement(res, hf16, untied)
        report[f"{name}_bf16_vs_hf_fp32"] = agreement(res, hf32)
    print("teacher-forced argmax agreement:", report)
    rate, total = report["flashinfer_bf16_vs_hf_bf16"]
    noise = report["hf_bf16_vs_hf_fp32"][0]
    assert total >= 2000
    assert report["flashinfer_bf16_vs_hf_bf16_untied"][0] >= 0.99, report
    assert rate >= 0.98 and rate >= noise - 0.005, report
    assert rate >= report["hf_bf16_eager_attention_vs_hf_bf16"][0] - 0.005, report
    assert report["flashinfer_bf16_vs_hf_fp32"][0] >= noise - 0.005, report
    assert report["triton_fp8kv_bf16_vs_hf_fp32"][0] >= noise - 0.03, report
