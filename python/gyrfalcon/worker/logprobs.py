"""Sampler outputs: chosen tokens and logprobs, and their conversion to IPC messages.

All logprobs here are of the model's raw distribution: log_softmax of the raw
logits in float32 (no penalties, no temperature).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gyrfalcon.forward.host_copy import upload
from gyrfalcon.ipc.messages import PositionLogprobs, RowResult, ScheduledRow, TokenLogprob

if TYPE_CHECKING:
    from gyrfalcon.worker.request_table import WorkerRequest

# prompt_logprobs works on at most this many logits at a time (bounds its float32 copies).
_PROMPT_LOGPROBS_CHUNK_ELEMS = 1 << 24


@dataclass
class SampleOutput:
    """Result of `sample`; tensors stay on the logits' device until `cpu()`."""

    token_ids: torch.Tensor  # [bs] int64
    logprobs: torch.Tensor | None  # [bs] float32, raw logprob of the chosen token
    top_ids: torch.Tensor | None  # [bs, max_logprobs] int64, by logprob descending
    top_logprobs: torch.Tensor | None  # [bs, max_logprobs] float32, descending

    def cpu(self) -> SampleOutput:
        """Copy to host and wait (one device sync)."""
        return HostCopy(self).wait()


class HostCopy:
    """A SampleOutput on its way to the host: started at once, waited for in `wait()`.

    On CUDA the copies are asynchronous into pinned memory and an event marks
    their end, so the host can plan the next step before this one's ids are read.
    """

    def __init__(self, out: SampleOutput):
        tensors = [out.token_ids, out.logprobs, out.top_ids, out.top_logprobs]
        device = out.token_ids.device
        self._event: torch.cuda.Event | None = None
        if device.type == "cpu":
            self._out = out
        elif device.type == "cuda":
            host = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
            self._out = SampleOutput(*host)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(device))
        else:
            self._out = SampleOutput(*(None if t is None else t.cpu() for t in tensors))

    def done(self) -> bool:
        """Whether `wait()` would return without blocking."""
        return self._event is None or self._event.query()

    def wait(self) -> SampleOutput:
        if self._event is not None:
            # NOTE: the one device->host sync of a step's sampling results.
            self._event.synchronize()
        return self._out


def to_position_logprobs(out: SampleOutput, row: int, k: int) -> PositionLogprobs:
    """Row `row` of `out` as a PositionLogprobs whose top list is cut to `k` entries.

    Call on `out.cpu()`: on device tensors every read here is a host sync.
    """
    if out.logprobs is None or out.top_ids is None or out.top_logprobs is None:
        raise ValueError("logprobs were not computed for this batch")
    if not 0 <= k <= out.top_ids.shape[1]:
        raise ValueError(f"k={k} outside [0, {out.top_ids.shape[1]}]")
    ids = out.top_ids[row, :k].tolist()
    lps = out.top_logprobs[row, :k].tolist()
    return PositionLogprobs(
        token_id=int(out.token_ids[row]),
        logprob=float(out.logprobs[row]),
        top=[TokenLogprob(token_id=i, logprob=lp) for i, lp in zip(ids, lps)],
    )


def top_k_lowest_ids(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row of x [n, vocab], in descending order, equal
    values by ascending id -> (values [n, k], ids [n, k] int64). No host sync.

    NOTE: `torch.topk` orders equal values arbitrarily, and 16-bit logits tie often
    (at the top of ~2.5% of SmolLM2's bf16 positions). Greedy decoding takes the
    lowest id among equals (`torch.argmax`, the Triton argmax), so here too: the first
    entry is always the token greedy decoding picks.
    """
    n, vocab = x.shape
    if k == 0:
        return x.new_empty((n, 0)), torch.empty((n, 0), dtype=torch.int64, device=x.device)
    kth = x.topk(k, dim=-1).values[:, -1:]  # [n, 1]
    above, at = x > kth, x == kth  # [n, vocab] each
    room = k - above.sum(-1, keepdim=True, dtype=torch.int32)  # [n, 1]: places left for ties
    keep = above | (at & (at.cumsum(-1, dtype=torch.int32) <= room))  # k per row
    ids = torch.arange(vocab, device=x.device, dtype=torch.int32).expand(n, vocab)
    ids = torch.where(keep, ids, vocab).topk(k, dim=-1, largest=False).values  # ascending
    ids = ids.clamp_(max=vocab - 1).long()  # NOTE: only a NaN row keeps fewer than k
    vals = x.gather(1, ids)
    order = vals.sort(dim=-1, descending=True, stable=True).indices  # ties stay id-ascending
    return vals.gather(1, order), ids.gather(1, order)


def raw_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of the model's raw distribution (log_softmax of logits [n, vocab] in float32):
    each row's logprob of token_ids[row] [n] and its top k (`top_k_lowest_ids`) ->
    (chosen [n], top ids [n, k], top logprobs [n, k]). A few rows at a time
    (`prompt_logprob_rows`): no float32 copy of every row's logits at once. No host sync."""
    n, vocab = logits.shape
    step = prompt_logprob_rows(vocab)
    chosen, ids, lps = [], [], []
    for s in range(0, n, step):
        lp = torch.log_softmax(logits[s : s + step], dim=-1, dtype=torch.float32)  # [c, vocab]
        chosen.append(lp.gather(1, token_ids[s : s + step, None]).squeeze(1))
        top_lp, top_ids = top_k_lowest_ids(lp, k)
        ids.append(top_ids)
        lps.append(top_lp)
    if len(chosen) == 1:
        return chosen[0], ids[0], lps[0]
    return torch.cat(chosen), torch.cat(ids), torch.cat(lps)


def prompt_logprob_rows(vocab: int) -> int:
    """Prompt positions scored at once: their logits stay within a bounded size whatever
    the chunk's length (the callers compute logits this many rows at a time too)."""
    return max(1, _PROMPT_LOGPROBS_CHUNK_ELEMS // vocab)


def prompt_logprobs(logits: torch.Tensor, next_ids: torch.Tensor, k: int) -> list[PositionLogprobs]:
    """Per prompt position i: logprob of next_ids[i] under log_softmax(logits[i]), its
    rank (1 + the number of tokens with a strictly larger logprob) and the top-k.

    logits: [n, vocab] any float dtype; next_ids: [n] int. Works in row chunks to
    bound memory; NOTE: one device->host sync per chunk (the result is Python).
    """
    n, vocab = logits.shape
    if next_ids.shape != (n,):
        raise ValueError(f"next_ids {tuple(next_ids.shape)} does not match logits ({n}, ...)")
    k = min(k, vocab)
    chunk = prompt_logprob_rows(vocab)
    result: list[PositionLogprobs] = []
    for start in range(0, n, chunk):
        lp = torch.log_softmax(logits[start : start + chunk].float(), dim=-1)  # [c, vocab]
        ids = next_ids[start : start + chunk].to(device=lp.device, dtype=torch.int64)  # [c]
        chosen = lp.gather(1, ids[:, None]).squeeze(1)  # [c]
        rank = (lp > chosen[:, None]).sum(-1) + 1  # [c]: 1 = the most probable token
        top_lp, top_ids = top_k_lowest_ids(lp, k)  # [c, k] each
        for tok, c_lp, c_rank, t_ids, t_lps in zip(
            ids.tolist(), chosen.tolist(), rank.tolist(), top_ids.tolist(), top_lp.tolist()
        ):
            top = [TokenLogprob(token_id=i, logprob=x) for i, x in zip(t_ids, t_lps)]
            result.append(PositionLogprobs(token_id=tok, logprob=c_lp, top=top, rank=c_rank))
    return result


def fill_prompt_logprobs(
    rows: Sequence[ScheduledRow],
    reqs: Sequence[WorkerRequest],
    hidden: torch.Tensor,
    q_starts: Sequence[int],
    results: Sequence[RowResult],
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    vocab: int,
    device: torch.device,
) -> None:
    """The logprob of each prompt token given its prefix, into results[i].prompt_logprobs
    for the rows whose requests asked; hidden: the step's [T, H] (row i's tokens from
    q_starts[i]), their logits computed a slice at a time."""
    # NOTE: a comprehension finds the few rows that asked (most steps: none)
    asked = [i for i, req in enumerate(reqs) if req.sampling.params.prompt_logprobs is not None]
    for i in asked:
        row, req = rows[i], reqs[i]
        k = req.sampling.params.prompt_logprobs
        assert k is not None
        # positions p in [start, end) predict the prompt token at p + 1
        end = min(row.start + len(row.input_ids), len(req.prompt_ids) - 1)
        if end <= row.start:
            continue
        first = q_starts[i]
        next_ids = upload(req.prompt_ids[row.start + 1 : end + 1], torch.int64, device)
        # NOTE: logits a slice at a time: a whole chunk's would be chunk x vocab floats
        lps: list = []
        step = prompt_logprob_rows(vocab)
        for s in range(0, end - row.start, step):
            h = hidden[first + s : first + min(s + step, end - row.start)]
            lps += prompt_logprobs(compute_logits(h), next_ids[s : s + len(h)], k)
        results[i].prompt_logprobs = lps
