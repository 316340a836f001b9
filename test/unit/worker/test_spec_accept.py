"""Speculative acceptance (chain drafts): the last-accepted index, greedy verification
(token-identical to plain greedy decoding, ties included), exact rejection sampling
(chi-square against the target distribution, per sampling parameter), seeds."""

from __future__ import annotations

import pytest
import torch

from gyrfalcon.ipc.messages import SamplingParams
from gyrfalcon.worker.sampler import RequestSamplingState, prepare, sample, sampling_probs
from gyrfalcon.worker.spec_accept import (
    EMIT_PAD,
    greedy_verify,
    last_accepted_index,
    last_accepted_indices,
    rejection_sample,
)

CPU = torch.device("cpu")
# chi-square critical values at p = 0.001 by degrees of freedom
CHI2_P001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515, 6: 22.458, 7: 24.322}
SAMPLED = SamplingParams(temperature=1.0)
GREEDY = SamplingParams(temperature=0.0)


def make_batch(params: list[SamplingParams], vocab: int):
    return prepare([RequestSamplingState.create(p, [0], CPU) for p in params], vocab, CPU)


def chi_square_ok(tokens: torch.Tensor, probs: torch.Tensor) -> bool:
    """Whether tokens look drawn from probs: none outside its support, chi-square < p=0.001."""
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    support = probs > 0
    if observed[~support].sum() > 0:
        return False
    expected = probs[support].double() / probs.sum() * tokens.numel()
    stat = float(((observed[support] - expected) ** 2 / expected).sum())
    return stat < CHI2_P001[int(support.sum()) - 1]


def test_last_accepted_index_for_accept_len_zero_and_k():
    k = 3
    assert [last_accepted_index(r, k, 0) for r in range(3)] == [0, 4, 8]  # never -1
    assert [last_accepted_index(r, k, k) for r in range(3)] == [3, 7, 11]
    assert last_accepted_index(2, 1, 1) == 5


@pytest.mark.parametrize("k", [1, 3, 5])
def test_last_accepted_indices_of_mixed_batches(k):
    for accept_len in ([0, 0, 0], [k, k, k], [0, k, 1 % (k + 1), 0]):
        a = torch.tensor(accept_len)
        idx = last_accepted_indices(a, k)
        rows = torch.arange(len(accept_len))
        assert idx.tolist() == [r * (k + 1) + x for r, x in enumerate(accept_len)]
        assert torch.equal(idx // (k + 1), rows) and torch.equal(idx % (k + 1), a)
        assert torch.equal(idx, last_accepted_index(rows, k, a))  # the one formula
        hidden = torch.arange(len(accept_len) * (k + 1))  # flat verify positions
        assert torch.equal(hidden[idx], idx)  # gathers in bounds


def test_greedy_verify_accepts_the_matching_prefix_and_emits_one_target_token():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [1, 2, 3, 4]])
    drafts = torch.tensor([[5, 6, 7], [9, 6, 7], [5, 6, 0], [1, 0, 3]])
    acc = greedy_verify(target, drafts)
    assert acc.accept_len.tolist() == [3, 0, 2, 1]
    assert acc.num_emitted.tolist() == [4, 1, 3, 2]
    P = EMIT_PAD
    assert acc.token_ids.tolist() == [[5, 6, 7, 8], [5, P, P, P], [5, 6, 7, P], [1, 2, P, P]]
    assert acc.last_token_ids.tolist() == [8, 5, 7, 2]


def test_greedy_ties_go_to_the_lowest_id():
    logits = torch.tensor([[0.0, 1.0, 3.0, 0.5, 3.0], [3.0, 3.0, 3.0, 0.0, 0.0]])
    target = sample(logits, make_batch([GREEDY] * 2, 5)).token_ids  # the engine's greedy
    assert target.tolist() == [2, 0]
    # one draft per row: the higher tied id is rejected and corrected to the lowest
    acc = greedy_verify(torch.stack([target, target], dim=1), torch.tensor([[4], [0]]))
    assert acc.accept_len.tolist() == [0, 1]
    assert acc.token_ids.tolist() == [[2, EMIT_PAD], [0, 0]]


@pytest.mark.parametrize("path", ["greedy_verify", "rejection_sample"])
@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_greedy_spec_decoding_equals_plain_greedy_token_for_token(k, path):
    vocab, bs, steps = 10, 4, 40
    gen = torch.Generator().manual_seed(k)
    # a toy target: logits of the next token from the last two; values 0..2, so ties abound
    table = torch.randint(0, 3, (vocab, vocab, vocab), generator=gen).float()

    def logits_of(ctx: list[int]) -> torch.Tensor:
        return table[ctx[-2], ctx[-1]]

    prompts = [[i, (3 * i + 1) % vocab] for i in range(bs)]
    plain = [list(p) for p in prompts]
    for _ in range(steps):
        logits = torch.stack([logits_of(c) for c in plain])
        for c, t in zip(plain, sample(logits, make_batch([GREEDY] * bs, vocab)).token_ids):
            c.append(int(t))
    ctx, seen, tie_breaks = [list(p) for p in prompts], set(), 0
    while min(len(c) for c in ctx) < steps + 2:
        drafts = []
        for c in ctx:  # a drafter right half the time, else the highest tied id or noise
            row = list(c)
            for _ in range(k):
                top = logits_of(row)
                coin = float(torch.rand((), generator=gen))
                tied = (top == top.max()).nonzero().flatten()
                guess = tied[0] if coin < 0.5 else tied[-1] if coin < 0.75 else top.argmin()
                row.append(int(guess))
            drafts.append(row[len(c) :])
        # verify position j scores the context plus the first j drafts
        logits = torch.stack(
            [logits_of(c + d[:j]) for c, d in zip(ctx, drafts) for j in range(k + 1)]
        )
        batch = make_batch([GREEDY] * len(ctx) * (k + 1), vocab)
        draft_ids = torch.tensor(drafts)
        if path == "greedy_verify":
            acc = greedy_verify(sample(logits, batch).token_ids.view(bs, k + 1), draft_ids)
        else:
            p = sampling_probs(logits, batch).view(bs, k + 1, vocab)
            q = torch.nn.functional.one_hot(draft_ids, vocab).float()
            acc = rejection_sample(p, q, draft_ids, make_batch([GREEDY] * bs, vocab))
        seen.update(acc.accept_len.tolist())
        for c, d, a in zip(ctx, drafts, acc.accept_len.tolist()):
            top = logits_of(c)
            if top[d[0]] == top.max() and d[0] != int(top.argmax()):  # a higher tied id
                tie_breaks += 1
                assert a == 0
        for c, toks, n in zip(ctx, acc.token_ids.tolist(), acc.num_emitted.tolist()):
            c.extend(toks[:n])
    assert [c[: steps + 2] for c in ctx] == plain
    assert {0, k} <= seen and tie_breaks > 0  # rejection at once, full acceptance, ties


def rejection_run(p: torch.Tensor, q: torch.Tensor, n: int = 40000, seed: int = 0):
    """n unseeded rows drafting from q [k, V] (drafts drawn here), verified against p [k + 1, V]."""
    k, vocab = q.shape
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        drafts = torch.multinomial(q, n, replacement=True).T.contiguous()  # [n, k]
        batch = make_batch([SAMPLED] * n, vocab)
        return rejection_sample(p.expand(n, -1, -1), q.expand(n, -1, -1), drafts, batch)


def normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(dim=-1, keepdim=True)


def _pairs() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(3, 8, generator=g), dim=-1)  # k = 2, V = 8
    q = torch.softmax(torch.randn(2, 8, generator=g) * 1.5, dim=-1)
    one_hot = torch.zeros(2, 8)
    one_hot[0, 3] = one_hot[1, 5] = 1.0  # a greedy drafter
    far = normalize(1.0 / p[:2] ** 2)  # mass where p has little: total variation 0.94
    truncated = normalize(p * (torch.arange(8) < 4))  # p with zeros; q spreads over them
    return {
        "random": (p, q),
        "one_hot_q": (p, one_hot),
        "far_q": (p, far),
        "p_with_zeros": (truncated, normalize(torch.ones(2, 8))),
    }


@pytest.mark.parametrize("name", list(_pairs()))
def test_rejection_sampling_emits_the_target_distribution(name):
    p, q = _pairs()[name]
    acc = rejection_run(p, q)
    assert chi_square_ok(acc.token_ids[:, 0], p[0])
    # the second token, given the first draft was accepted, follows p_1
    second = acc.token_ids[acc.accept_len >= 1, 1]
    assert second.numel() > 2000 and chi_square_ok(second, p[1])
    bonus = acc.token_ids[acc.accept_len == 2, 2]  # both accepted: the bonus follows p_2
    assert bonus.numel() > 500 and chi_square_ok(bonus, p[2])
    if name == "one_hot_q":  # accept probability p(d); the residual never holds d
        rate = (acc.accept_len >= 1).double().mean()
        assert abs(rate - p[0, 3]) < 0.02
        assert not (acc.token_ids[acc.accept_len == 0, 0] == 3).any()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.6),
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.7),
        SamplingParams(min_p=0.15),
        SamplingParams(temperature=1.3, top_k=5, top_p=0.9, min_p=0.05),
    ],
)
def test_rejection_sampling_follows_the_processed_target(params):
    """p and q both through `sampling_probs` with the same params; drafts from `sample`."""
    vocab, k, n = 8, 2, 20000
    g = torch.Generator().manual_seed(1)
    target_logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    draft_logits = target_logits[:k] + torch.randn(k, vocab, generator=g)
    single = make_batch([params], vocab)
    expected = [sampling_probs(target_logits[j : j + 1], single)[0] for j in range(k + 1)]
    with torch.random.fork_rng():
        torch.manual_seed(2)
        batch = make_batch([params] * n, vocab)
        rows = [x.expand(n, -1).contiguous() for x in (*target_logits, *draft_logits)]
        p = torch.stack([sampling_probs(x, batch) for x in rows[: k + 1]], dim=1)
        q = torch.stack([sampling_probs(x, batch) for x in rows[k + 1 :]], dim=1)
        drafts = torch.stack([sample(x, batch).token_ids for x in rows[k + 1 :]], dim=1)
        acc = rejection_sample(p, q, drafts, batch)
    assert chi_square_ok(acc.token_ids[:, 0], expected[0])
    assert chi_square_ok(acc.token_ids[acc.accept_len >= 1, 1], expected[1])
    # not vacuous: the processed target is not the raw softmax
    assert not chi_square_ok(acc.token_ids[:, 0], torch.softmax(target_logits[0], dim=-1))


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0.6, top_k=4), SamplingParams(top_p=0.8, min_p=0.1)]
)
def test_sampling_probs_is_what_sample_draws_from(params):
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(3)) * 1.5
    probs = sampling_probs(logits, make_batch([params], 8))[0]
    with torch.random.fork_rng():
        torch.manual_seed(4)
        tokens = sample(logits.expand(20000, -1), make_batch([params] * 20000, 8)).token_ids
    assert chi_square_ok(tokens, probs)


def test_sampling_probs_exact_values():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0]] * 3)
    params = [
        SamplingParams(temperature=0.0, logit_bias={3: 5.0}),  # greedy, after the bias
        SamplingParams(temperature=0.0),  # greedy tie: lowest id
        SamplingParams(temperature=2.0),
    ]
    probs = sampling_probs(logits, make_batch(params, 4))
    assert probs[0].tolist() == [0, 0, 0, 1] and probs[1].tolist() == [0, 1, 0, 0]
    assert torch.allclose(probs[2], torch.softmax(logits[2] / 2.0, dim=-1))


def test_corner_cases_equal_p_q_zero_target_and_zero_draft_probability():
    p = torch.tensor([[0.5, 0.5, 0.0, 0.0]] * 3)
    # p == q: every draft accepted
    acc = rejection_run(p, p[:2], n=500)
    assert acc.accept_len.tolist() == [2] * 500
    # p(d) == 0: rejected, corrected inside p's support
    drafts = torch.full((500, 2), 2)
    q = torch.tensor([[0.0, 0.0, 1.0, 0.0]] * 2)
    batch = make_batch([SAMPLED] * 500, 4)
    acc = rejection_sample(p.expand(500, -1, -1), q.expand(500, -1, -1), drafts, batch)
    assert acc.accept_len.tolist() == [0] * 500 and set(acc.token_ids[:, 0].tolist()) == {0, 1}
    # guard q(d) == 0: accepted iff p(d) > 0; p == q with p(d) == 0: drawn from p
    drafts = torch.tensor([[0, 3]] * 500)
    acc = rejection_sample(p.expand(500, -1, -1), q.expand(500, -1, -1), drafts, batch)
    assert acc.accept_len.tolist() == [1] * 500
    drafts = torch.full((500, 2), 2)
    acc = rejection_sample(p.expand(500, -1, -1), p[:2].expand(500, -1, -1), drafts, batch)
    assert acc.accept_len.tolist() == [0] * 500 and set(acc.token_ids[:, 0].tolist()) == {0, 1}


def random_case(gen: torch.Generator, bs: int, k: int, vocab: int):
    p = torch.softmax(torch.randn(bs, k + 1, vocab, generator=gen) * 2, dim=-1)
    q = torch.softmax(torch.randn(bs, k, vocab, generator=gen) * 2, dim=-1)
    drafts = torch.multinomial(q.view(-1, vocab), 1, generator=gen).view(bs, k)
    return p, q, drafts


def test_seeded_row_is_reproducible_and_independent_of_the_batch():
    vocab, k = 12, 3
    seeded = SamplingParams(temperature=0.9, seed=7)
    others = [SAMPLED, SamplingParams(temperature=0.7, seed=5), SamplingParams(temperature=0.0)]

    def run(layout: str, params: SamplingParams = seeded) -> list[list[int]]:
        state = RequestSamplingState.create(params, [0], CPU)
        rest = [RequestSamplingState.create(o, [0], CPU) for o in others]
        at = {"alone": 0, "first": 0, "middle": 2}[layout]
        states = [state] if layout == "alone" else [*rest[:at], state, *rest[at:]]
        gen, out = torch.Generator().manual_seed(0), []
        for _ in range(12):
            mine = random_case(gen, 1, k, vocab)  # the row's inputs: the same in every layout
            theirs = random_case(gen, 3, k, vocab)
            if layout != "alone":
                mine = [torch.cat([y[:at], x, y[at:]]) for x, y in zip(mine, theirs)]
            acc = rejection_sample(*mine, prepare(states, vocab, CPU))
            out.append(acc.token_ids[at, : int(acc.num_emitted[at])].tolist())
        return out

    alone = run("alone")
    assert run("alone") == alone and run("first") == alone and run("middle") == alone
    assert len({len(x) for x in alone}) > 1  # acceptance varies over the steps
    assert run("alone", SamplingParams(temperature=0.9, seed=8)) != alone


def test_documented_draw_order_of_a_seeded_row():
    """k uniforms, then V exponentials, from the row's generator, every step."""
    vocab, k = 9, 3
    state = RequestSamplingState.create(SamplingParams(seed=123), [0], CPU)
    mirror = torch.Generator().manual_seed(123)
    gen = torch.Generator().manual_seed(1)
    for _ in range(20):
        p, q, d = random_case(gen, 1, k, vocab)
        acc = rejection_sample(p, q, d, prepare([state], vocab, CPU))
        u = torch.empty(k).uniform_(generator=mirror)
        e = torch.empty(vocab).exponential_(generator=mirror)
        ok = [bool(u[j] < p[0, j, d[0, j]] / q[0, j, d[0, j]]) for j in range(k)]
        a = ok.index(False) if False in ok else k
        resid = (p[0, a] - (q[0, a] if a < k else 0)).clamp_min(0)
        assert int(acc.accept_len[0]) == a
        assert int(acc.last_token_ids[0]) == int((resid.log() - e.log()).argmax())


def test_greedy_rows_in_a_sampled_batch_use_the_greedy_rule_and_no_rng():
    vocab, k = 10, 3
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4 * (k + 1), vocab, generator=gen)
    params = [GREEDY, SAMPLED, SamplingParams(temperature=0.0, seed=3), SamplingParams(seed=4)]
    states = [RequestSamplingState.create(x, [0], CPU) for x in params]
    before = states[2].generator.get_state().clone()
    per_position = prepare([s for s in states for _ in range(k + 1)], vocab, CPU)
    one_hot = sampling_probs(logits, per_position).view(4, k + 1, vocab)  # on greedy rows
    soft = torch.softmax(logits, dim=-1).view(4, k + 1, vocab)  # greedy rows use its argmax
    target = logits.argmax(dim=-1).view(4, k + 1)
    drafts = torch.stack([target[:, 0], target[:, 1], (target[:, 2] + 1) % vocab], dim=1)
    q = torch.softmax(torch.randn(4, k, vocab, generator=gen), dim=-1)
    greedy = greedy_verify(target, drafts)
    for _ in range(10):
        for p in (one_hot, soft):
            acc = rejection_sample(p, q, drafts, prepare(states, vocab, CPU))
            assert acc.accept_len[[0, 2]].tolist() == greedy.accept_len[[0, 2]].tolist() == [2, 2]
            assert torch.equal(acc.token_ids[[0, 2]], greedy.token_ids[[0, 2]])
    assert torch.equal(states[2].generator.get_state(), before)


SIZES = [(1, 7), (1, 6), (4, 13)]  # ranges of bs, k, vocab


def test_acceptance_properties_over_random_batches():
    gen = torch.Generator().manual_seed(5)
    choices = [GREEDY, SAMPLED, SamplingParams(temperature=0.5, seed=1), SamplingParams(seed=2)]
    for _ in range(40):
        bs, k, vocab = (int(torch.randint(lo, hi, (), generator=gen)) for lo, hi in SIZES)
        p, q, drafts = random_case(gen, bs, k, vocab)
        keep = (torch.rand(p.shape, generator=gen) < 0.7) | (p == p.amax(-1, keepdim=True))
        p = normalize(p * keep)  # targets with zeros (truncated), never all zero
        params = [choices[int(i)] for i in torch.randint(0, 4, (bs,), generator=gen)]
        acc = rejection_sample(p, q, drafts, make_batch(params, vocab))
        a, tokens = acc.accept_len, acc.token_ids
        assert tokens.shape == (bs, k + 1) and ((a >= 0) & (a <= k)).all()
        assert torch.equal(acc.num_emitted, a + 1)
        j = torch.arange(k + 1)[None, :]
        assert torch.equal(tokens[:, :k][j[:, :k] < a[:, None]], drafts[j[:, :k] < a[:, None]])
        assert (tokens[j > a[:, None]] == EMIT_PAD).all()
        last = acc.last_token_ids
        assert ((last >= 0) & (last < vocab)).all()
        # the target's token is inside p's support at the last accepted position
        flat_p = p.reshape(bs * (k + 1), vocab)
        assert (flat_p[last_accepted_indices(a, k), last] > 0).all()


def test_rows_with_fewer_drafts_stop_there_and_draw_the_bonus_from_that_position():
    """num_drafts caps acceptance per row; at the cap the token follows p at that
    position (q := 0), so a row with 0 drafts samples plain from p_0."""
    p, q = _pairs()["random"]  # k = 2
    n = 20000
    for d in (0, 1):
        with torch.random.fork_rng():
            torch.manual_seed(3)
            drafts = torch.multinomial(q, n, replacement=True).T.contiguous()
            batch = make_batch([SAMPLED] * n, 8)
            nd = torch.full((n,), d, dtype=torch.int64)
            acc = rejection_sample(
                p.expand(n, -1, -1), q.expand(n, -1, -1), drafts, batch, num_drafts=nd
            )
        assert int(acc.accept_len.max()) <= d
        assert chi_square_ok(acc.token_ids[:, 0], p[0])
        if d == 1:
            bonus = acc.token_ids[acc.accept_len == 1, 1]  # capped: drawn from p_1 itself
            assert bonus.numel() > 2000 and chi_square_ok(bonus, p[1])
        assert acc.token_ids[:, d + 1 :].eq(EMIT_PAD).all()  # never a token past the cap
    target = torch.tensor([[4, 5, 6], [4, 5, 6]])
    acc = greedy_verify(target, torch.tensor([[4, 5], [4, 5]]), torch.tensor([1, 0]))
    assert acc.accept_len.tolist() == [1, 0]
    assert acc.token_ids.tolist() == [[4, 5, EMIT_PAD], [4, EMIT_PAD, EMIT_PAD]]


def test_a_greedy_drafter_needs_no_draft_distribution():
    """draft_probs None (the engine's drafter proposes greedily): the very tokens and
    draws of passing its one-hot distribution, with seeded, unseeded and greedy rows
    and rows of fewer drafts, without a [bs, k, V] tensor."""
    vocab, k = 11, 3
    params = [SAMPLED, SamplingParams(temperature=0.8, seed=9), GREEDY, SamplingParams(seed=2)]
    gen = torch.Generator().manual_seed(4)
    for step in range(20):
        p, _, drafts = random_case(gen, len(params), k, vocab)
        one_hot = torch.nn.functional.one_hot(drafts, vocab).float()
        num_drafts = torch.tensor([3, 1, 2, 0]) if step % 2 else None
        out = []
        for q in (one_hot, None):
            states = [RequestSamplingState.create(x, [0], CPU) for x in params]
            with torch.random.fork_rng():
                torch.manual_seed(step)
                out.append(
                    rejection_sample(
                        p, q, drafts, prepare(states, vocab, CPU), num_drafts=num_drafts
                    )
                )
        assert torch.equal(out[0].accept_len, out[1].accept_len)
        assert torch.equal(out[0].token_ids, out[1].token_ids)
