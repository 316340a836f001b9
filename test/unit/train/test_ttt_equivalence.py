"""The training forward IS the engine's drafter: `ttt_unroll` on the parameters of a
`LlamaForCausalLMEagle3` equals its engine forward over a paged KV cache (torch_ref),
step 0 a DRAFT_EXTEND and steps 1, 2 DRAFT_DECODE steps fed the previous outputs, for
every row of a padded batch of two sequences, in float32; the loss reaches every
trainable parameter and never the target's embedding; padding a batch further (up to
--seq-bucket) changes neither the loss nor any gradient."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_hf_model

from gyrfalcon.config.model_config import ModelConfig
from gyrfalcon.forward.batch import ForwardBatch
from gyrfalcon.forward.kv_cache import KVCache
from gyrfalcon.forward.metadata import RowInput, build_batch_tensors
from gyrfalcon.ipc.messages import ForwardMode
from gyrfalcon.layers.attention.torch_ref import TorchRefBackend
from gyrfalcon.layers.context import LayerContext
from gyrfalcon.models.registry import build_model
from gyrfalcon.train import ttt
from gyrfalcon.train.args import TrainArgs
from gyrfalcon.train.drafter import build_drafter, draft_config_for
from gyrfalcon.train.evaluate import run_batch
from gyrfalcon.train.features import Features
from gyrfalcon.train.objective import TargetView
from gyrfalcon.train.ttt import draft_logits, ttt_unroll

CPU = torch.device("cpu")
PAGE = 4
STEPS = 3
LENGTHS = (12, 9)  # a padded batch: the second sequence is shorter
TOL = dict(atol=2e-5, rtol=2e-5)
RIGHT_MASK = ttt.ttt_mask


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny-target"))
    make_tiny_hf_model(path, "llama", num_hidden_layers=4)
    cfg = ModelConfig.from_dir(path)
    return build_model(cfg, path, torch.float32, CPU, LayerContext(), show_progress=False)


def make_drafter(target, seed: int = 0, norm_before_residual: bool = False):
    gen = torch.Generator().manual_seed(seed)
    draft_ids = torch.randperm(target.cfg.vocab_size, generator=gen)[:48].sort().values
    cfg = draft_config_for(target.cfg, 48, "float32", norm_before_residual=norm_before_residual)
    drafter = build_drafter(cfg, target, draft_ids, CPU, seed)
    with torch.no_grad():  # NOTE: norms off one, head off the target's: every one matters
        for name, p in drafter.named_parameters():
            if not name.startswith("embed_tokens."):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return drafter


def engine_round(drafter, ids: torch.Tensor, fused: torch.Tensor) -> list[torch.Tensor]:
    """Row p (p < n - STEPS for n = len(ids)) extends feature positions 0..p (ids
    t_1..t_{p+1}), then drafts STEPS - 1 tokens, step j feeding t_{p+1+j} and the
    previous step's output at position p + j. Returns, per step, [rows, H]: the extend's
    output at p, then each decode step's; rows interleave their pages."""
    lyr = drafter.cfg.layer
    backend = TorchRefBackend(lyr.num_heads, lyr.num_kv_heads, lyr.head_dim, lyr.head_dim**-0.5)
    rows = len(ids) - STEPS
    need = -(-(rows + STEPS) // PAGE)
    pages = [[1 + r + i * rows for i in range(need)] for r in range(rows)]
    cache = KVCache(1, 1 + need * rows, PAGE, lyr.num_kv_heads, lyr.head_dim, torch.float32, CPU)

    def run(mode, batch_rows, hidden):
        bt = build_batch_tensors(batch_rows, PAGE, CPU)
        batch = ForwardBatch.from_tensors(mode, bt, PAGE, cache, backend)
        batch.attn_meta = backend.build_metadata(batch)
        with torch.inference_mode():
            return drafter(batch, hidden)

    ext = [RowInput(0, ids[1 : p + 2].tolist(), pages[p]) for p in range(rows)]
    out = run(ForwardMode.DRAFT_EXTEND, ext, torch.cat([fused[: p + 1] for p in range(rows)]))
    last = torch.arange(1, rows + 1).cumsum(0) - 1
    outs = [out[last]]
    for j in range(1, STEPS):
        dec = [RowInput(p + j, [int(ids[p + 1 + j])], pages[p]) for p in range(rows)]
        outs.append(run(ForwardMode.DRAFT_DECODE, dec, outs[-1]))
    return outs


def padded_batch(target, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    s, h = max(LENGTHS), target.cfg.hidden_size
    ids = torch.randint(0, target.cfg.vocab_size, (len(LENGTHS), s), generator=gen)
    aux = torch.randn(len(LENGTHS), s, 3 * h, generator=gen)
    for b, n in enumerate(LENGTHS):  # NOTE: what `Features.batch` pads with
        ids[b, n:], aux[b, n:] = ids[b, n - 1], aux[b, n - 1]
    return ids, aux


def assert_unroll_equals_engine(drafter, ids, aux) -> None:
    with torch.no_grad():
        outs = ttt_unroll(drafter, ids, aux, STEPS)  # STEPS x [B, S, H]
    assert len(outs) == STEPS and outs[0].shape == (*ids.shape, drafter.cfg.hidden_size)
    for b, n in enumerate(LENGTHS):
        with torch.no_grad():
            fused = drafter.fuse(aux[b, :n])
        want = engine_round(drafter, ids[b, :n], fused)
        for j in range(STEPS):
            got = outs[j][b, : want[j].shape[0]]
            torch.testing.assert_close(got, want[j], **TOL, msg=f"sequence {b}, step {j}")
            torch.testing.assert_close(
                draft_logits(drafter, got), drafter.compute_logits(want[j]), **TOL
            )


@pytest.mark.parametrize("norm_before_residual", [False, True])
def test_unroll_equals_the_engine_extend_and_decode_steps(target, norm_before_residual):
    """Both residual layouts (--norm-before-residual: vLLM's speculators variant)."""
    drafter = make_drafter(target, norm_before_residual=norm_before_residual)
    assert drafter.midlayer.norm_before_residual == norm_before_residual
    assert_unroll_equals_engine(drafter, *padded_batch(target))


def eagle_repo_mask(seq_len: int, step: int, device=None) -> torch.Tensor:
    """The EAGLE repository trainer's mask: also hides step-0 keys p - step + 1 .. p."""
    mask = RIGHT_MASK(seq_len, step, device).clone()
    for i in range(step):
        rows = torch.arange(i, seq_len)
        mask[rows, rows - i] = False
    return mask


def no_draft_keys_mask(seq_len: int, step: int, device=None) -> torch.Tensor:
    mask = RIGHT_MASK(seq_len, step, device).clone()
    mask[:, seq_len:] = False
    return mask


@pytest.mark.parametrize("wrong", [eagle_repo_mask, no_draft_keys_mask])
def test_another_mask_would_be_caught(target, monkeypatch, wrong):
    """Guard on the guard: masks the engine does not use fail at step 1."""
    monkeypatch.setattr(ttt, "ttt_mask", wrong)
    with pytest.raises(AssertionError, match="step 1"):
        assert_unroll_equals_engine(make_drafter(target), *padded_batch(target))


def tiny_features(target, seed: int = 5) -> Features:
    """Two sequences of LENGTHS tokens, prompts of 3 and 2, random target states."""
    gen = torch.Generator().manual_seed(seed)
    n, h = sum(LENGTHS), target.cfg.hidden_size
    final = torch.randn(n, h, generator=gen)
    return Features(
        ids=torch.randint(0, target.cfg.vocab_size, (n,), generator=gen),
        aux=torch.randn(n, 3 * h, generator=gen),
        final=final,
        target_argmax=target.compute_logits(final).argmax(-1),
        starts=[0, LENGTHS[0]],
        lengths=list(LENGTHS),
        prompt_lens=[3, 2],
    )


def train_args(**kw) -> TrainArgs:
    return TrainArgs(
        prompts="p.jsonl", output_dir="out", device="cpu", ttt_steps=STEPS, **kw
    ).resolved()


def test_the_loss_trains_every_drafter_parameter_and_never_the_target(target):
    drafter = make_drafter(target)
    batch = tiny_features(target).batch([0, 1], 1, STEPS)
    loss, results = run_batch(drafter, target, batch, train_args(), CPU)
    loss.backward()
    # row p of step j predicts the token at p + 2 + j, an answer token that exists
    want_rows = [sum(n - max(pl, 2 + j) for n, pl in zip(LENGTHS, (3, 2))) for j in range(STEPS)]
    assert [r.rows for r in results] == want_rows == [16, 15, 13]
    for name, p in drafter.named_parameters():
        if name.startswith("embed_tokens."):
            assert p.grad is None and not p.requires_grad, name
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_the_loss_is_the_textbook_cross_entropy_over_each_steps_rows(target):
    """The loss of each step against a direct computation: for every sequence, row p
    and step j with an answer token at t = p + 2 + j whose target argmax is drafted,
    -sum softmax(target logits at t - 1, draft ids) log_softmax(draft logits of row p),
    averaged; hits where the drafter's argmax is the target's."""
    drafter = make_drafter(target)
    features = tiny_features(target)
    batch = features.batch([0, 1], 1, STEPS)
    with torch.no_grad():
        _, results = run_batch(drafter, target, batch, train_args(), CPU)
        outs = ttt_unroll(drafter, batch.ids, batch.aux, STEPS)
    d2t = drafter.draft_to_target
    for j in range(STEPS):
        ces, hits = [], 0
        for b, (start, n, pl) in enumerate(zip(features.starts, LENGTHS, (3, 2))):
            for p in range(n):
                t = p + 2 + j
                if not pl <= t < n:
                    continue
                f = features.final[start + t - 1]
                want = int(features.target_argmax[start + t - 1])
                x = draft_logits(drafter, outs[j][b, p])
                hits += int(d2t[x.argmax()] == want)
                if drafter.t2d[want]:
                    q = torch.softmax(target.compute_logits(f[None])[0, d2t], -1)
                    ces.append(-(q * torch.log_softmax(x, -1)).sum())
        torch.testing.assert_close(results[j].loss, torch.stack(ces).mean(), **TOL)
        assert int(results[j].hits) == hits, j


@pytest.mark.parametrize("reach_weight", [0.5, 1.0])
def test_reach_weight_scores_later_steps_on_the_rows_a_greedy_server_reaches(target, reach_weight):
    """--reach-weight w: row p of step j weighs (1 - w) + w where the drafter's argmax was
    the target's at steps 0..j-1 of row p (a server verifies draft j + 1 only after the
    first j were accepted), 1 - w elsewhere; the loss is the weighted mean. The target's
    choices are drafted ids, the drafter's own step-0 drafts at every other row, so
    step 1 reaches some rows and not others."""
    drafter = make_drafter(target)
    features = tiny_features(target)
    batch = features.batch([0, 1], 1, STEPS)
    with torch.no_grad():
        outs = ttt_unroll(drafter, batch.ids, batch.aux, STEPS)
    d2t = drafter.draft_to_target
    choice = {}  # (b, p, j) -> the drafter's argmax as a target id
    for b, n in enumerate(LENGTHS):
        for p in range(n):
            for j in range(STEPS):
                choice[b, p, j] = int(d2t[draft_logits(drafter, outs[j][b, p]).argmax()])
    features.target_argmax[:] = d2t[torch.arange(len(features.ids)) * 7 % len(d2t)]
    for b, start in enumerate(features.starts):
        for p in range(0, LENGTHS[b] - 2, 2):  # step 0 of row p scores position p + 1
            features.target_argmax[start + p + 1] = choice[b, p, 0]
    batch = features.batch([0, 1], 1, STEPS)
    with torch.no_grad():
        _, plain = run_batch(drafter, target, batch, train_args(), CPU)
        _, weighted = run_batch(drafter, target, batch, train_args(reach_weight=reach_weight), CPU)
    reached_rows = 0
    for j in range(STEPS):
        ces, weights = [], []
        for b, (start, n, pl) in enumerate(zip(features.starts, LENGTHS, (3, 2))):
            for p in range(n):
                t = p + 2 + j
                if not pl <= t < n:
                    continue
                assert drafter.t2d[features.target_argmax[start + t - 1]]  # all scored
                hit_before = all(
                    pl <= p + 2 + i < n
                    and choice[b, p, i] == int(features.target_argmax[start + p + 1 + i])
                    for i in range(j)
                )
                reached_rows += int(j > 0 and hit_before)
                f = features.final[start + t - 1]
                q = torch.softmax(target.compute_logits(f[None])[0, d2t], -1)
                x = draft_logits(drafter, outs[j][b, p])
                ces.append(-(q * torch.log_softmax(x, -1)).sum())
                weights.append(1.0 - reach_weight + reach_weight * hit_before)
        w = torch.tensor(weights)
        want_loss = (torch.stack(ces) * w).sum() / w.sum().clamp(min=1)
        torch.testing.assert_close(weighted[j].loss, want_loss, **TOL, msg=f"step {j}")
        assert int(weighted[j].hits) == int(plain[j].hits)  # acceptance is not weighted
    assert reached_rows >= 6
    assert not torch.allclose(weighted[1].loss, plain[1].loss, **TOL)
    torch.testing.assert_close(weighted[0].loss, plain[0].loss, **TOL)


@pytest.mark.parametrize("bucket", [16, 64])
def test_padding_up_to_a_bucket_changes_no_loss_and_no_gradient(target, bucket):
    """One training step on a batch padded to a multiple of `bucket` (4 and 52 more
    positions than its longest sequence) equals the step on the batch padded to its
    longest sequence only: the same loss, acceptance counts and gradients."""
    features = tiny_features(target)
    args = train_args()
    drafter = make_drafter(target)

    def step(bucket: int):
        drafter.zero_grad(set_to_none=True)
        batch = features.batch([0, 1], bucket, STEPS)
        loss, results = run_batch(drafter, target, batch, args, CPU)
        loss.backward()
        grads = {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}
        return batch.ids.shape[1], loss.detach(), [(int(r.hits), r.rows) for r in results], grads

    s, loss, counts, grads = step(1)
    s_padded, loss_padded, counts_padded, grads_padded = step(bucket)
    assert (s, s_padded) == (max(LENGTHS), bucket)
    torch.testing.assert_close(loss_padded, loss, **TOL)
    assert counts_padded == counts and counts[0][1] == 16
    assert grads_padded.keys() == grads.keys() and len(grads) > 5
    for name, g in grads.items():
        torch.testing.assert_close(grads_padded[name], g, **TOL, msg=name)


def test_target_view_is_the_full_logits_at_the_draft_ids(target):
    """The view computes the target's logits at the draft ids only (its LM head's rows
    there): the whole vocabulary's logits gathered there."""
    drafter = make_drafter(target)
    final = torch.randn(18, target.cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    logits = target.compute_logits(final)
    view = TargetView.of(target, final, drafter.draft_to_target, logits.argmax(-1))
    torch.testing.assert_close(view.logits, logits[:, drafter.draft_to_target], **TOL)
    assert view.logits.shape[-1] < logits.shape[-1]
