"""Random greedy requests through EAGLE3 against the same requests without it (CPU,
float32): each request draws max_tokens, min_tokens, stop ids taken from its own plain
output (so they are met inside accepted runs, and some before min_tokens allows them),
logit_bias, logprobs and EOS or not, in a pool small enough to preempt; the drafter is
forced to a random acceptance pattern (spec_util.force_drafts). Tokens, logprobs and
finish reasons must be identical, and every page must come back."""

from __future__ import annotations

import random

import pytest
from spec_util import engine, force_drafts, make_pair, prompts, random_pattern, run

from gyrfalcon.ipc.messages import SamplingParams


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("spec-random"))


def _request(rng: random.Random, free_run: list[int]) -> SamplingParams:
    """Random greedy parameters; stop ids and biased ids come from `free_run`, what the
    request emits with no stop at all."""
    max_tokens = rng.randint(1, 14)
    seen = free_run[:max_tokens]
    stops = rng.sample(seen, min(len(seen), rng.randint(0, 2)))
    bias = {t: rng.choice([-5.0, 3.0]) for t in rng.sample(seen, min(len(seen), rng.randint(0, 1)))}
    return SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        min_tokens=rng.choice([0, 0, rng.randint(0, max_tokens)]),
        stop_token_ids=stops,
        ignore_eos=rng.random() < 0.5,
        logprobs=rng.choice([None, 0, 2]),
        logit_bias=bias,
    )


@pytest.mark.parametrize("seed", range(6))
def test_random_greedy_requests_match_plain_decoding(pair, seed):
    target, draft = pair
    rng = random.Random(seed)
    k = rng.choice([1, 2, 3, 5])
    ps = prompts(20 + seed, [rng.randint(3, 24) for _ in range(6)])
    free = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    free_runs = run(engine(target), ps, free).ids
    sps = [_request(rng, out) for out in free_runs]
    small = dict(
        num_kv_pages=12, chunked_prefill_size=8, max_num_batched_tokens=16,
        schedule_conservativeness=0.0,
    )  # fmt: skip
    plain = run(engine(target, **small), ps, sps)
    eng = engine(target, draft, k, **small)
    seqs = {str(i): p + o for i, (p, o) in enumerate(zip(ps, plain.ids))}
    made = force_drafts(eng, seqs, random_pattern(seed, k), k)
    got = run(eng, ps, sps)
    for i, sp in enumerate(sps):
        want, have = plain.final[i], got.final[i]
        assert got.ids[i] == plain.ids[i], (i, sp)
        assert have.finish_reason == want.finish_reason, (i, sp)
        assert [(p.token_id, [t.token_id for t in p.top]) for p in got.logprobs[i]] == [
            (p.token_id, [t.token_id for t in p.top]) for p in plain.logprobs[i]
        ], (i, sp)
        for a, b in zip(got.logprobs[i], plain.logprobs[i]):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4), (i, sp)
    assert made and got.verify_steps > 0
    assert eng.scheduler.counters.preemptions > 0
