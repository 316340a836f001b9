"""Drives a StepWorker with hand-built step plans, for decode benchmarks.

The Driver plays the scheduler's part for a fixed set of sequences: it hands
out KV pages, prefills prompts in plans of a token cap, and runs decode steps,
synchronized or overlapped (each submitted before the previous one is read,
its input filled on the device through PLACEHOLDER, as the server runs them).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence

import torch

from gyrfalcon.ipc import messages as msg
from gyrfalcon.ipc.contract import PLACEHOLDER
from gyrfalcon.worker.step_worker import StepWorker

GREEDY = msg.SamplingParams(temperature=0.0, max_tokens=1 << 30, ignore_eos=True)


def last_tokens(result: msg.StepResult) -> dict[str, int]:
    """The last token each sampling row emitted (the next step's input), by rid."""
    return {r.rid: r.token_ids[-1] for r in result.rows if r.token_ids}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclasses.dataclass
class Seq:
    rid: str
    prompt: list[int]
    pages: list[int] = dataclasses.field(default_factory=list)
    kv_len: int = 0  # tokens whose K/V are in the cache
    last: int = -1  # token sampled last step (the next step's input)


class Driver:
    """Feeds hand-built StepPlans to a StepWorker and tracks pages like a scheduler."""

    def __init__(
        self, runner: StepWorker, page_size: int, num_pages: int, shuffle_seed: int | None = None
    ):
        """shuffle_seed: hand pages out in a seeded random order (a server's cache after
        many requests) instead of in ascending order."""
        self.runner, self.page_size = runner, page_size
        self.free_pages = list(range(num_pages - 1, 0, -1))  # page 0 is the dummy page
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(self.free_pages)
        self.seqs: list[Seq] = []
        self.step_id = 0

    def _grow(self, seq: Seq, length: int) -> list[int]:
        """Allocate pages so `seq` holds `length` tokens; returns the new ones."""
        need = -(-length // self.page_size) - len(seq.pages)
        if need > len(self.free_pages):
            raise RuntimeError("out of KV pages; the page budget is computed wrongly")
        new = [self.free_pages.pop() for _ in range(max(0, need))]
        seq.pages.extend(new)
        return new

    def _run(
        self,
        mode: msg.ForwardMode,
        rows: list[msg.ScheduledRow],
        new: Sequence[msg.NewRequest] = (),
        finished: Sequence[str] = (),
    ) -> dict[str, int]:
        """Execute one plan; returns the last emitted token of each sampling row by rid."""
        batch = msg.RankBatch(mode, rows, list(new), list(finished))
        plan = msg.StepPlan(self.step_id, [batch])
        self.step_id += 1
        return last_tokens(self.runner.execute(plan))

    def prefill(self, prompts: list[list[int]], token_cap: int) -> None:
        """Add requests and compute their prompts in plans of at most `token_cap` tokens."""
        base = self.step_id
        self.seqs = [Seq(f"{base}-{i}", p) for i, p in enumerate(prompts)]
        rows: list[msg.ScheduledRow] = []
        new: list[msg.NewRequest] = []
        chunks: list[tuple[Seq, int]] = []
        budget = token_cap
        for seq in self.seqs:
            new.append(msg.NewRequest(seq.rid, seq.prompt, GREEDY))
            start = 0
            while start < len(seq.prompt):
                end = start + min(len(seq.prompt) - start, budget)
                pages = self._grow(seq, end)
                last = end == len(seq.prompt)
                rows.append(msg.ScheduledRow(seq.rid, start, seq.prompt[start:end], pages, last))
                chunks.append((seq, end - start))
                budget -= end - start
                start = end
                if budget == 0:
                    self._flush_prefill(rows, new, chunks)
                    rows, new, chunks, budget = [], [], [], token_cap
        if rows:
            self._flush_prefill(rows, new, chunks)

    def _flush_prefill(
        self, rows: list[msg.ScheduledRow], new: list[msg.NewRequest], chunks: list[tuple[Seq, int]]
    ) -> None:
        out = self._run(msg.ForwardMode.PREFILL, rows, new)
        for seq, n in chunks:
            seq.kv_len += n
            if seq.kv_len == len(seq.prompt):
                seq.last = out[seq.rid]

    def submit_decode(self, overlap: bool) -> None:
        """Launch one decode step: every sequence consumes the token it sampled last.

        With `overlap` the input is PLACEHOLDER, which the runner fills on the device
        from the previous step, so this step can go out before that one's result is read.
        """
        rows = [
            msg.ScheduledRow(
                s.rid,
                s.kv_len,
                [PLACEHOLDER if overlap else s.last],
                self._grow(s, s.kv_len + 1),
                True,
            )
            for s in self.seqs
        ]
        plan = msg.StepPlan(self.step_id, [msg.RankBatch(msg.ForwardMode.DECODE, rows)])
        self.step_id += 1
        self.runner.submit(plan)
        for s in self.seqs:
            s.kv_len += 1

    def take(self) -> None:
        """Read the oldest submitted decode step's tokens."""
        out = last_tokens(self.runner.take())
        for s in self.seqs:
            s.last = out[s.rid]

    def decode(self) -> None:
        """One decode step, waited for."""
        self.submit_decode(overlap=False)
        self.take()

    def decode_overlapped(self, steps: int) -> None:
        """`steps` decode steps with one more always submitted before the oldest is read."""
        for _ in range(steps):
            self.submit_decode(overlap=True)
            if len(self.runner.pending) > 1:
                self.take()
        while self.runner.pending:
            self.take()

    def release(self) -> None:
        """Free every sequence on the worker (finished_rids) and return its pages."""
        while self.runner.pending:  # a step cut short by an error
            self.runner.take()
        self._run(msg.ForwardMode.IDLE, [], finished=[s.rid for s in self.seqs])
        for s in self.seqs:
            self.free_pages.extend(reversed(s.pages))
        self.seqs = []
        assert not self.runner.requests, "the worker kept state of freed requests"
