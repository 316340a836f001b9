"""The pure index math of training-time test: the attention mask, the shift of the
inputs, which rows count, the acceptance length, the learning-rate schedule."""

from __future__ import annotations

import os

import pytest
import torch

from gyrfalcon.train.features import Features, bucketed
from gyrfalcon.train.objective import acceptance_length, served_rounds
from gyrfalcon.train.rows import ScoredRows, plan_rows
from gyrfalcon.train.trainer import HOST_THREADS, limit_host_threads, lr_factor
from gyrfalcon.train.ttt import query_heads, shift_left, ttt_mask


def test_step_zero_is_plain_causal():
    assert torch.equal(ttt_mask(4, 0), torch.ones(4, 4, dtype=torch.bool).tril())


def test_step_two_attends_the_features_causally_and_its_own_earlier_drafts():
    # columns: step 0 rows 0..3 | step 1 rows 0..3 | step 2 rows 0..3
    want = torch.tensor(
        [
            [1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0],
            [1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0],
            [1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(ttt_mask(4, 2), want)


def test_mask_by_rule():
    s, step = 7, 3
    m = ttt_mask(s, step)
    assert m.shape == (s, (step + 1) * s)
    for p in range(s):
        for c in range(step + 1):
            for r in range(s):
                attends = r <= p if c == 0 else r == p
                assert bool(m[p, c * s + r]) == attends, (p, c, r)
    # row p attends p + 1 features and `step` drafts: what the engine's cache holds
    assert m.sum(1).tolist() == [p + 1 + step for p in range(s)]


def test_query_heads_repeat_each_kv_head_for_its_group():
    kv = torch.randn(2, 7, 3, 4)
    got = query_heads(kv, 9)  # [B, heads, L, D]: query head h reads KV head h // 3
    assert got.shape == (2, 9, 7, 4)
    for h in range(9):
        assert torch.equal(got[:, h], kv[:, :, h // 3])


def test_shift_left():
    x = torch.arange(10).view(2, 5)
    assert shift_left(x, 0) is x
    assert shift_left(x, 2).tolist() == [[2, 3, 4, 0, 0], [7, 8, 9, 0, 0]]
    assert shift_left(x, 7).tolist() == [[0] * 5, [0] * 5]
    h = torch.randn(2, 5, 3)
    assert torch.equal(shift_left(h, 1)[:, :4], h[:, 1:]) and not shift_left(h, 1)[:, 4].any()


def step_mask(plan, lengths, prompt_lens, seq_len: int, step: int) -> torch.Tensor:
    """[B, S] bool: the rows `ScoredRows.at_step` counts at `step`."""
    valid, _ = ScoredRows(*plan.row_arrays(seq_len)).at_step(step)
    mask = torch.zeros(len(lengths), seq_len, dtype=torch.bool)
    mask[plan.seq[valid], plan.pos[valid]] = True
    return mask


def test_scored_rows_count_rows_predicting_existing_answer_tokens():
    lengths, prompt_lens = [8, 5], [4, 1]
    plan = plan_rows(lengths, prompt_lens, steps=3)
    # step 0: row p predicts token p + 2: answer tokens 4..7 and 2..4 (token 1 cannot be
    # predicted: no row has a feature before it)
    assert step_mask(plan, lengths, prompt_lens, 8, 0).int().tolist() == [
        [0, 0, 1, 1, 1, 1, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
    ]
    assert step_mask(plan, lengths, prompt_lens, 8, 2).int().tolist() == [
        [1, 1, 1, 1, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 0, 0, 0],
    ]
    # the union of steps 0..2: rows 0..5 and 0..2
    assert list(zip(plan.seq.tolist(), plan.pos.tolist())) == [(0, p) for p in range(6)] + [
        (1, p) for p in range(3)
    ]
    # the scoring positions q = 3..6 and 0..3, one per answer token
    assert plan.target_pos.tolist() == [3, 4, 5, 6, 0, 1, 2, 3]
    assert plan.target_seq.tolist() == [0] * 4 + [1] * 4 and plan.target_start.tolist() == [0, 4]


@pytest.mark.parametrize("seed", range(5))
def test_scored_rows_against_the_definition(seed):
    """Every step's rows are exactly those with prompt_len <= p + 2 + j < length, all in
    the union, each scored by the target position p + 1 + j of its own sequence."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 30, (6,), generator=gen).tolist()
    prompt_lens = [int(torch.randint(1, n + 1, (1,), generator=gen)) for n in lengths]
    steps, s = 4, max(lengths)
    plan = plan_rows(lengths, prompt_lens, steps)
    rows = ScoredRows(*plan.row_arrays(s))
    assert torch.equal(rows.flat, rows.seq * s + rows.pos)
    for j in range(steps):
        want = torch.tensor(
            [[pl <= p + 2 + j < n for p in range(s)] for n, pl in zip(lengths, prompt_lens)]
        )
        assert torch.equal(step_mask(plan, lengths, prompt_lens, s, j), want), j
        valid, target_row = rows.at_step(j)
        assert torch.equal(plan.target_seq[target_row[valid]], plan.seq[valid])
        assert torch.equal(plan.target_pos[target_row[valid]], plan.pos[valid] + 1 + j)
    # the union holds no row that no step counts
    counted = sum(step_mask(plan, lengths, prompt_lens, s, j).int() for j in range(steps))
    assert bool((counted[plan.seq, plan.pos] > 0).all())


def test_acceptance_length():
    assert acceptance_length([]) == 1.0
    assert acceptance_length([1.0, 1.0, 1.0]) == 4.0
    assert acceptance_length([0.0, 1.0]) == 1.0
    assert acceptance_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)


def test_bucketed_batches_take_few_lengths():
    assert [bucketed(n, 64) for n in (1, 63, 64, 65, 300)] == [64, 64, 64, 128, 320]
    assert bucketed(37, 1) == 37
    # batches of every longest length from 40 to 500: 8 padded lengths, not 461
    lengths = list(range(40, 501))
    features = Features(
        ids=torch.zeros(sum(lengths), dtype=torch.int64),
        aux=torch.zeros(sum(lengths), 3),
        final=torch.zeros(sum(lengths), 1),
        target_argmax=torch.zeros(sum(lengths), dtype=torch.int64),
        starts=[sum(lengths[:i]) for i in range(len(lengths))],
        lengths=lengths,
        prompt_lens=[1] * len(lengths),
    )
    shapes = {features.batch([0, i], 64).ids.shape for i in range(len(lengths))}
    assert shapes == {(2, 64 * k) for k in range(1, 9)}
    assert features.batch([0, 5], 1).ids.shape == (2, 45)


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    assert lr_factor(0, 10, 100) == pytest.approx(0.1)
    assert lr_factor(9, 10, 100) == pytest.approx(1.0)
    assert lr_factor(10, 10, 100) == pytest.approx(1.0)
    assert lr_factor(100, 10, 100) == pytest.approx(0.1)
    values = [lr_factor(s, 10, 100) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_lr_schedule_decays_by_time_when_time_runs_out_first():
    """A run the time guard stops ends on the decayed rate: the cosine follows the
    share of --max-train-seconds spent when it is ahead of the steps."""
    assert lr_factor(50, 10, 100, time_share=1.0) == pytest.approx(0.1)
    assert lr_factor(50, 10, 100, time_share=2.0) == pytest.approx(0.1)
    by_steps = lr_factor(55, 10, 100)  # halfway through the cosine
    assert by_steps == pytest.approx(0.55)
    assert lr_factor(55, 10, 100, time_share=0.2) == by_steps  # the steps are ahead
    assert lr_factor(20, 10, 100, time_share=0.5) == pytest.approx(0.55)
    assert lr_factor(5, 10, 100, time_share=0.9) == pytest.approx(0.6)  # warm-up first


def hit_table(k: int, length: int, prompt_len: int, pattern) -> torch.Tensor:
    """hits[j, p] = pattern(j, p) where draft j from row p has a token to predict."""
    hits = torch.zeros(k, length, dtype=torch.bool)
    for j in range(k):
        for p in range(length):
            hits[j, p] = prompt_len <= p + 2 + j < length and pattern(j, p)
    return hits


def test_served_rounds_follow_the_server():
    """Answer tokens at 2..9 (prompt of 2, length 10), k = 3. The prefill emits token 2."""
    every = hit_table(3, 10, 2, lambda j, p: True)
    # rounds from rows 1 (tokens 3, 4, 5 + 6) and 5 (7, 8, 9: clipped at the end)
    assert served_rounds(every, 2, 10) == (2, 7)
    # no draft right: a round per token
    assert served_rounds(hit_table(3, 10, 2, lambda j, p: False), 2, 10) == (7, 7)
    # the second draft of the round from row 1 fails: 1 accepted, 2 emitted, then row 3
    # (tokens 5, 6, 7 + 8) and row 7 (token 9 only)
    mixed = hit_table(3, 10, 2, lambda j, p: not (p == 1 and j == 1))
    assert served_rounds(mixed, 2, 10) == (3, 7)


def test_served_rounds_emit_every_answer_token_once():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        length = int(torch.randint(3, 40, (1,), generator=gen))
        prompt_len = int(torch.randint(1, length - 1, (1,), generator=gen))
        hits = torch.rand(4, length, generator=gen) < 0.7
        hits &= hit_table(4, length, prompt_len, lambda j, p: True)
        steps, emitted = served_rounds(hits, prompt_len, length)
        assert emitted == length - prompt_len - 1  # all but the prefill's token
        assert steps <= emitted and (steps == 0) == (length - prompt_len == 1)


def test_served_rounds_below_the_rates_when_misses_cluster():
    """Misses at the same rows for every step (a hard stretch) leave the per-step rates
    at 3/4 each, and the rounds that start inside the stretch pay for it."""
    length, prompt_len = 42, 2
    hard = set(range(10, 20))
    hits = hit_table(3, length, prompt_len, lambda j, p: p + 2 + j not in hard)
    rows = [hit_table(3, length, prompt_len, lambda j, p: True)[j].sum() for j in range(3)]
    rates = [float(hits[j].sum() / rows[j]) for j in range(3)]
    steps, emitted = served_rounds(hits, prompt_len, length)
    assert emitted / steps < acceptance_length(rates)


def test_target_temperature_sharpens_the_learned_distribution_toward_the_target_choice():
    """--target-temperature T: the drafter learns softmax(target logits / T) at the draft
    ids; T = 1 is EAGLE3's soft target, T -> 0 the cross-entropy against the target's own
    choice (what greedy verification accepts); the target's argmax is unchanged."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from gyrfalcon.kernels.soft_cross_entropy import soft_cross_entropy
    from gyrfalcon.train.objective import TargetView

    gen = torch.Generator().manual_seed(0)
    vocab, draft_vocab, hidden, m = 40, 12, 8, 6
    head = torch.randn(vocab, hidden, generator=gen)
    target = SimpleNamespace(lm_head=SimpleNamespace(rows=lambda ids: head[ids]))
    draft_to_target = torch.randperm(vocab, generator=gen)[:draft_vocab]
    final = torch.randn(m, hidden, generator=gen)
    argmax = (final @ head.T).argmax(-1)
    drafted = torch.randn(m, draft_vocab, generator=gen)
    rows = torch.arange(m)

    soft = TargetView.of(target, final, draft_to_target, argmax)
    at_draft_ids = final @ head[draft_to_target].T
    torch.testing.assert_close(soft.logits, at_draft_ids)
    expected = -(torch.softmax(at_draft_ids, -1) * F.log_softmax(drafted, -1)).sum(-1)
    torch.testing.assert_close(soft_cross_entropy(drafted, soft.logits, rows)[0], expected)

    sharp = TargetView.of(target, final, draft_to_target, argmax, temperature=0.01)
    assert torch.equal(sharp.argmax, argmax)
    torch.testing.assert_close(sharp.logits, at_draft_ids / 0.01)
    choice = at_draft_ids.argmax(-1)
    hard = F.cross_entropy(drafted, choice, reduction="none")
    torch.testing.assert_close(soft_cross_entropy(drafted, sharp.logits, rows)[0], hard)
    assert not torch.allclose(expected, hard, atol=1e-2)  # T = 1 is not the hard target


def test_a_cuda_run_limits_its_host_threads_and_a_cpu_run_keeps_them(monkeypatch):
    """A CUDA trainer's CPU threads: HOST_THREADS, for its engine copies too (they read
    OMP_NUM_THREADS when spawned); a CPU run computes on them, so it keeps torch's
    default; a user's own OMP_NUM_THREADS wins."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        limit_host_threads(torch.device("cpu"))
        assert torch.get_num_threads() == before and "OMP_NUM_THREADS" not in os.environ
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        limit_host_threads(torch.device("cuda"))
        assert torch.get_num_threads() == before and os.environ["OMP_NUM_THREADS"] == "3"
        monkeypatch.delenv("OMP_NUM_THREADS")
        limit_host_threads(torch.device("cuda"))
        assert torch.get_num_threads() == HOST_THREADS
        assert os.environ["OMP_NUM_THREADS"] == str(HOST_THREADS)
    finally:
        torch.set_num_threads(before)


def test_reach_weight_chains_the_hits_of_every_earlier_step(monkeypatch):
    """--reach-weight w: step j's rows weigh 1 where steps 0..j-1 all hit (a greedy
    server verifies draft j + 1 there), 1 - w elsewhere; step 0 and w = 0 unweighted."""
    from types import SimpleNamespace

    from gyrfalcon.train import objective

    hits = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 1, 1, 0], [0, 1, 1, 1, 1]], dtype=torch.bool)
    seen = []

    def fake_step(drafter, out, view, rows, step, weight=None):
        seen.append(weight)
        return SimpleNamespace(loss=torch.tensor(float(step + 1)), hit_rows=hits[step])

    monkeypatch.setattr(objective, "step_result", fake_step)
    total, _ = objective.ttt_loss(None, [torch.zeros(1)] * 3, None, None, 0.5, reach_weight=0.75)
    assert seen[0] is None
    torch.testing.assert_close(seen[1], torch.tensor([1.0, 1.0, 0.25, 1.0, 0.25]))
    # row 2 hit at step 1 but not at step 0: a server never verifies its third draft
    torch.testing.assert_close(seen[2], torch.tensor([1.0, 0.25, 0.25, 1.0, 0.25]))
    torch.testing.assert_close(total, torch.tensor(1 + 0.5 * 2 + 0.25 * 3))
    seen.clear()
    objective.ttt_loss(None, [torch.zeros(1)] * 3, None, None, 0.5)
    assert seen == [None, None, None]
