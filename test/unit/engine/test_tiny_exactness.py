"""Greedy engine output == HF generate on tiny random Llama/Qwen2/Qwen3 (float32, CPU).

Covers batching, chunked prefill, mid-flight arrivals and preemption with a tiny KV pool.
"""

import pytest
import torch
from conftest import TINY_ARCHS

from gyrfalcon.config.server_args import ServerArgs
from gyrfalcon.engine import LocalEngine
from gyrfalcon.ipc.messages import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def hf_greedy(model_dir, prompts, n):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        g = m.generate(
            ids,
            max_new_tokens=n,
            do_sample=False,
            min_new_tokens=n,
            pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )
        outs.append(g[0, len(p) :].tolist())
    return outs


def prompts(seed, lens):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=gen).tolist() for n in lens]


def engine(model_dir, **kw):
    args = ServerArgs(model=model_dir, device="cpu", dtype="float32", page_size=4, **kw)
    return LocalEngine(args, model_dir)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_batched_greedy_matches_hf(tiny_model_dirs, arch):
    d = tiny_model_dirs[arch]
    ps = prompts(1, [5, 17, 9, 30])
    eng = engine(d, num_kv_pages=64, chunked_prefill_size=8)
    assert eng.generate(ps, GREEDY) == hf_greedy(d, ps, GREEDY.max_tokens)
    eng.check_integrity()
    assert eng.scheduler.num_free_pages == eng.scheduler.num_usable_pages


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_mid_flight_arrivals_and_preemption_match_hf(tiny_model_dirs, overlap):
    d = tiny_model_dirs["llama"]
    ps = prompts(2, [6, 11, 3, 14, 8])
    ref = hf_greedy(d, ps, GREEDY.max_tokens)
    # 12 usable pages of 4 tokens: not enough for all five at once -> preemption
    eng = engine(
        d,
        num_kv_pages=13,
        chunked_prefill_size=5,
        max_num_batched_tokens=7,
        disable_overlap_schedule=not overlap,
    )
    assert eng.scheduler.cfg.max_inflight == (2 if overlap else 1)
    got = {str(i): [] for i in range(len(ps))}
    eng.add("0", ps[0], GREEDY)
    preempted = 0
    step = 0
    while eng.has_work() or step < 2 * len(ps):
        if step % 2 == 0 and step // 2 < len(ps) and step > 0:
            eng.add(str(step // 2), ps[step // 2], GREEDY)
        for out in eng.step():
            got[out.rid].extend(out.token_ids)
        preempted += sum(1 for r in eng.scheduler.waiting if r.needs_reset)
        eng.check_integrity()
        step += 1
    assert preempted > 0, "the tiny pool should have forced a preemption"
    assert [got[str(i)] for i in range(len(ps))] == ref
    assert eng.scheduler.num_free_pages == eng.scheduler.num_usable_pages


def test_bfloat16_on_cpu_runs_and_mostly_agrees(tiny_model_dirs):
    """bf16 is not exact, but the engine must run it and stay close to float32."""
    d = tiny_model_dirs["llama"]
    ps = prompts(3, [9, 14])
    ref = engine(d, num_kv_pages=64).generate(ps, GREEDY)
    got = LocalEngine(
        ServerArgs(model=d, device="cpu", dtype="bfloat16", page_size=4, num_kv_pages=64), d
    ).generate(ps, GREEDY)
    assert [len(g) for g in got] == [GREEDY.max_tokens] * 2
    assert got[0][:2] == ref[0][:2] and got[1][:2] == ref[1][:2]


def prompt_logprobs(eng, prompt):
    """Teacher-forced logprob of every prompt token after the first."""
    eng.add("p", prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
    got = []
    while eng.has_work():
        for out in eng.step():
            got += [p.logprob for p in out.prompt_logprobs or [] if p is not None]
    assert len(got) == len(prompt) - 1
    return torch.tensor(got)


def test_prompt_logprobs_scored_a_slice_at_a_time_are_the_whole_chunks(
    tiny_model_dirs, monkeypatch
):
    """Long prompt chunks score their logprobs a few rows of logits at a time (a whole
    chunk's logits would be chunk x vocab floats): the values of scoring at once, up to
    float32 rounding (a matmul's sums may group differently with fewer rows)."""
    from gyrfalcon.worker import logprobs

    d = tiny_model_dirs["llama"]
    prompt = prompts(5, [30])[0]
    whole = prompt_logprobs(engine(d, num_kv_pages=64), prompt)
    eng = engine(d, num_kv_pages=64)
    vocab = eng.worker.cfg.vocab_size
    monkeypatch.setattr(logprobs, "_PROMPT_LOGPROBS_CHUNK_ELEMS", 4 * vocab)  # 4 rows a slice
    assert logprobs.prompt_logprob_rows(vocab) == 4
    assert torch.allclose(prompt_logprobs(eng, prompt), whole, rtol=0, atol=1e-5)


def test_fp8_kv_cache_on_cpu_stays_close_and_holds_more_pages(tiny_model_dirs):
    """e4m3 KV is not exact; the engine must run it, stay close to a float32 cache, and
    size 4x the pages of a float32 cache in the same memory."""
    d = tiny_model_dirs["llama"]
    kw = dict(max_cpu_kv_memory="2MiB", chunked_prefill_size=4)  # later chunks read the cache
    full, fp8 = engine(d, **kw), engine(d, kv_cache_dtype="fp8_e4m3", **kw)
    assert fp8.worker.executor.kv_cache.k.dtype == torch.float8_e4m3fn
    assert fp8.scheduler.cfg.num_pages == 4 * full.scheduler.cfg.num_pages
    prompt = prompts(3, [30])[0]
    ref, got = prompt_logprobs(full, prompt), prompt_logprobs(fp8, prompt)
    # this tiny model's logprobs spread over -3.5 .. -9 (std ~1.4); e4m3 keeps 3
    # mantissa bits, which moves them by ~0.09 nats on average here (0.28 at most):
    # well under a tenth of their spread, and not zero (the cache really is fp8)
    diff = (got - ref).abs()
    assert 0 < diff.mean() < 0.1 * ref.std() and diff.max() < 0.5, diff
    out = fp8.generate(prompts(4, [9, 14]), GREEDY)
    assert [len(g) for g in out] == [GREEDY.max_tokens] * 2
    fp8.check_integrity()
    assert fp8.scheduler.num_free_pages == fp8.scheduler.num_usable_pages


def test_overlap_keeps_sampled_and_stopped_outputs(tiny_model_dirs):
    """Seeded sampling, stop tokens, EOS and penalties: the same tokens with overlap as without.

    A request that stops has one more step in flight, whose token is dropped; a
    penalized row makes the runner wait for earlier steps' tokens first.
    """
    d = tiny_model_dirs["llama"]
    ps = prompts(4, [7, 12, 5, 9])
    ref_greedy = engine(d, num_kv_pages=64).generate(ps, GREEDY)
    stop_tok = ref_greedy[1][4]  # request 1 stops at its 5th token
    cases = [
        SamplingParams(temperature=1.0, seed=11, max_tokens=10),
        SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_tok]),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=9, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=8, frequency_penalty=0.5),
    ]

    def run(overlap):
        eng = engine(d, num_kv_pages=64, disable_overlap_schedule=not overlap)
        for i, (p, sp) in enumerate(zip(ps, cases)):
            eng.add(str(i), p, sp)
        got = {str(i): [] for i in range(len(ps))}
        while eng.has_work():
            for out in eng.step():
                got[out.rid].extend(out.token_ids)
        assert not eng.worker.requests and not eng.worker.pending
        eng.check_integrity()
        return [got[str(i)] for i in range(len(ps))]

    sync, over = run(False), run(True)
    assert over == sync
    assert sync[1][-1] == stop_tok and len(sync[1]) <= 5
