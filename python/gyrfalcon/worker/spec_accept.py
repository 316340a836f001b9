"""Acceptance of chain drafts (top-k 1): k draft tokens per row, verified by the
target's k + 1 distributions; pure functions, batched over rows, no host sync.

Verify position j (0..k) of row r is flat position `r * (k + 1) + j` of the verify
batch; its input is t_j (t_0 = the last accepted token, t_j = d_j) and its output
p_j is the target's distribution of the token after t_0..t_j. So draft d_{j+1}
(draft column j) is checked against p_j, and p_k gives the bonus token.

Greedy rows: accept the longest prefix with d_{j+1} == argmax p_j, then emit
argmax p_a at the first mismatch a (or a = k): token for token what plain greedy
decoding emits, ties included (argmax takes the lowest id, as the sampler does).

Sampled rows, exact rejection sampling (Leviathan et al. 2023; Chen et al. 2023),
with d ~ q: accept d with probability min(1, p(d) / q(d)); on rejection draw from
r = max(0, p - q) / Z, Z = sum max(0, p - q) = 1 - sum min(p, q). The emitted
token then follows p:  P(x) = q(x) min(1, p(x)/q(x)) + Z r(x)
                            = min(q(x), p(x)) + max(0, p(x) - q(x)) = p(x).
Repeated along the chain with p_j conditioned on the accepted d_1..d_j, the
emitted run follows the target's joint distribution. The bonus after k accepts is
the same draw with q := 0 (r = p_k).

Randomness, per step (`row_draws`: the default generator first, over all rows, if
any sampled row is unseeded; then each seeded sampled row's own generator, in row
order): 1. U [bs, k] uniform [0, 1); 2. E [bs, V] Exponential(1). A seeded row
thus draws k uniforms, then V exponentials from its generator, every step,
whatever it accepts; greedy rows draw nothing from theirs.

Rows with fewer drafts: `num_drafts[r]` = d_r <= k verifies only the first d_r
columns (the rest are padding): acceptance stops at d_r and position d_r gives the
bonus token, drawn from p_{d_r} itself (q := 0). A row with d_r = 0 samples one
token from p_0, as plain decoding does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gyrfalcon.kernels.dispatch import DEFAULT_KERNELS, KernelPolicy
from gyrfalcon.worker.sampler import SamplingBatch, argmax_rows, gumbel_argmax, row_draws

Index = int | torch.Tensor  # a Python int, or an int64 tensor of them

# Token id in `Acceptance.token_ids` after a row's emitted tokens (never a valid id).
EMIT_PAD = -1


def last_accepted_index(row: Index, k: int, accept_len: Index) -> Index:
    """Flat index into the [bs * (k + 1)] verify positions of row `row`'s last accepted
    position (the one whose output gave the emitted target token): in
    [row * (k + 1), row * (k + 1) + k] for accept_len in [0, k]. Ints or tensors.

    NOTE: the only formula for this index; no `row * (k + 1) - 1` baselines."""
    return row * (k + 1) + accept_len


def last_accepted_indices(accept_len: torch.Tensor, k: int) -> torch.Tensor:
    """`last_accepted_index` of every row: accept_len [bs] -> [bs] int64."""
    rows = torch.arange(accept_len.shape[0], device=accept_len.device)
    return last_accepted_index(rows, k, accept_len)


@dataclass
class Acceptance:
    """What each row of a verify step emits: its accepted drafts, then one target token."""

    accept_len: torch.Tensor  # [bs] int64, drafts accepted, in [0, k]
    token_ids: torch.Tensor  # [bs, k + 1] int64, emitted tokens, then EMIT_PAD

    @property
    def num_emitted(self) -> torch.Tensor:
        """[bs] int64: accept_len + 1."""
        return self.accept_len + 1

    @property
    def last_token_ids(self) -> torch.Tensor:
        """[bs] int64: each row's last emitted token (the target's)."""
        return self.token_ids.gather(1, self.accept_len[:, None]).squeeze(1)


def _accept_len(accepted: torch.Tensor, num_drafts: torch.Tensor | None) -> torch.Tensor:
    """Length of the all-True prefix of each row of accepted [bs, k] bool, at most the
    row's num_drafts [bs] (None: k) -> [bs] int64."""
    run = accepted.long().cumprod(dim=1).sum(dim=1)
    return run if num_drafts is None else torch.minimum(run, num_drafts)


def _emit(accept_len: torch.Tensor, draft_ids: torch.Tensor, final: torch.Tensor) -> Acceptance:
    """token_ids[:, j] = draft_ids[:, j] for j < a, final at j == a, EMIT_PAD after."""
    bs, k = draft_ids.shape
    j = torch.arange(k + 1, device=draft_ids.device)[None, :]  # [1, k + 1]
    a = accept_len[:, None]  # [bs, 1]
    drafts = torch.cat([draft_ids, draft_ids.new_full((bs, 1), EMIT_PAD)], dim=1)  # [bs, k + 1]
    tokens = torch.where(j < a, drafts, torch.where(j == a, final[:, None], EMIT_PAD))
    return Acceptance(accept_len, tokens)


def _greedy(
    target_ids: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(accept_len [bs], target token at the first mismatch [bs])."""
    k = draft_ids.shape[1]
    accept_len = _accept_len(draft_ids == target_ids[:, :k], num_drafts)
    return accept_len, target_ids.gather(1, accept_len[:, None]).squeeze(1)


def greedy_verify(
    target_ids: torch.Tensor, draft_ids: torch.Tensor, num_drafts: torch.Tensor | None = None
) -> Acceptance:
    """Greedy acceptance. target_ids: [bs, k + 1] int64, the target's greedy token at
    each verify position (argmax, lowest id among ties); draft_ids: [bs, k] int64;
    num_drafts: [bs] int64 drafts of each row (None: k each)."""
    assert target_ids.shape == (draft_ids.shape[0], draft_ids.shape[1] + 1), (
        target_ids.shape,
        draft_ids.shape,
    )
    accept_len, final = _greedy(target_ids, draft_ids, num_drafts)
    return _emit(accept_len, draft_ids, final)


def _argmax(probs: torch.Tensor, kernels: KernelPolicy) -> torch.Tensor:
    """argmax over the vocabulary of probs [bs, k + 1, V] -> [bs, k + 1] int64."""
    return argmax_rows(probs.flatten(0, 1), kernels).view(probs.shape[:2])


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    draft_ids: torch.Tensor,
    batch: SamplingBatch,
    kernels: KernelPolicy = DEFAULT_KERNELS,
    num_drafts: torch.Tensor | None = None,
) -> Acceptance:
    """Exact speculative sampling of a batch that may mix greedy and sampled rows.

    target_probs: [bs, k + 1, V] float32, p_j = `sampling_probs` of the target's
        verify logits at position j (greedy rows use only its argmax);
    draft_probs: [bs, k, V] float32, q_j: the distribution d_{j+1} was drawn from,
        over the target vocabulary; None: a greedy drafter, q_j = one-hot(d_{j+1}),
        never materialized (then q(d) = 1, and max(0, p - q) is p with d zeroed, as
        p <= 1: the same values, bit for bit, as passing the one-hot tensor);
    draft_ids: [bs, k] int64; batch: the step's `SamplingBatch` of the bs requests
        (greedy rows, generators). k >= 1. See the module docstring for the draws;
    num_drafts: [bs] int64 drafts of each row, <= k (None: k each).
    """
    bs, k1, vocab = target_probs.shape
    k = k1 - 1
    assert k >= 1 and draft_ids.shape == (bs, k)
    assert draft_probs is None or draft_probs.shape == (bs, k, vocab)
    assert batch.batch_size == bs, (batch.batch_size, bs)
    if batch.all_greedy:
        return greedy_verify(_argmax(target_probs, kernels), draft_ids, num_drafts)
    u = row_draws(batch, k, target_probs.device, torch.Tensor.uniform_)  # [bs, k]
    p_d = target_probs[:, :k].gather(2, draft_ids[..., None]).squeeze(2)  # [bs, k]
    if draft_probs is None:
        q_d = torch.ones_like(p_d)
    else:
        q_d = draft_probs.gather(2, draft_ids[..., None]).squeeze(2)  # [bs, k]
    # u < p / q without dividing; NOTE: q(d) == 0 (impossible for a drawn d) accepts iff p(d) > 0.
    accept_len = _accept_len(u * q_d < p_d, num_drafts)  # [bs]
    at = accept_len[:, None, None].expand(bs, 1, vocab)  # [bs, 1, V]
    p_a = target_probs.gather(1, at).squeeze(1)  # [bs, V]
    drafts = k if num_drafts is None else num_drafts
    rejected = (accept_len < drafts)[:, None]  # [bs, 1]; bonus position: q := 0, so r = p_a
    if draft_probs is None:
        d_a = draft_ids.gather(1, accept_len.clamp(max=k - 1)[:, None])  # [bs, 1]
        resid = torch.where(rejected, p_a.scatter(1, d_a, 0.0), p_a)  # [bs, V]
    else:
        q_a = draft_probs.gather(1, at.clamp(max=k - 1)).squeeze(1)  # [bs, V]
        resid = (p_a - q_a * rejected).clamp_min_(0.0)  # [bs, V]
    # NOTE: max(0, p - q) == 0 everywhere only when p == q (a rejection there needs
    # p(d) == q(d) == 0): then draw from p.
    resid = torch.where(resid.sum(dim=1, keepdim=True) > 0, resid, p_a)
    final = gumbel_argmax(resid.log(), batch, kernels)  # [bs], draws from resid / Z
    if batch.any_greedy:
        assert batch.greedy is not None
        g_len, g_final = _greedy(_argmax(target_probs, kernels), draft_ids, num_drafts)
        accept_len = torch.where(batch.greedy, g_len, accept_len)
        final = torch.where(batch.greedy, g_final, final)
    return _emit(accept_len, draft_ids, final)
