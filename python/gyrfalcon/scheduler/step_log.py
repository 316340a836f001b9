"""What the engine did, in counters and a periodic log line (throughput, batch, queue, KV)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from gyrfalcon.scheduler.policy import Decision


def is_decode_row(num_tokens: int, num_generated: int) -> bool:
    """A row computing one token of a request that has output is a decode row."""
    return num_tokens == 1 and num_generated > 0


@dataclass
class StepCounters:
    """Totals since start-up, counted when plans are built (and, for tokens beyond a
    row's first, when its result is in)."""

    steps: int = 0
    prompt_tokens: int = 0  # tokens of prefill rows (recomputed prompts included)
    generated_tokens: int = 0  # rows that sample, plus the accepted drafts they kept
    preemptions: int = 0
    verify_steps: int = 0  # sampling rows that verified drafts (speculative decoding)
    accepted: int = 0  # drafts they accepted

    def add_verified(self, num_accepted: int) -> None:
        """A row that verified drafts came back with num_accepted of them accepted."""
        self.verify_steps += 1
        self.accepted += num_accepted

    def add(self, decisions: Iterable[Decision]) -> None:
        """Count one step's decisions (one per DP rank) before they are applied."""
        self.steps += 1
        for decision in decisions:
            for s in decision.rows:
                if not is_decode_row(s.num_tokens, s.req.num_generated):
                    self.prompt_tokens += s.num_tokens
                self.generated_tokens += s.samples
            self.preemptions += len(decision.preempted)

    def add_kept(self, num_kept: int) -> None:
        """A sampling row's result kept num_kept >= 1 tokens; its first is counted."""
        self.generated_tokens += num_kept - 1


class ThroughputLog:
    """Formats a line every `interval_s` seconds from the counters' growth since the last."""

    def __init__(self, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.interval_s, self.clock = interval_s, clock
        self.last_t = clock()
        self.last = StepCounters()

    def line(
        self, now: StepCounters, running: int, waiting: int, used_pages: int, total_pages: int
    ) -> str | None:
        """The log line if an interval has passed and work was done in it, else None."""
        t = self.clock()
        dt = t - self.last_t
        if self.interval_s <= 0 or dt < self.interval_s:
            return None
        d_steps = now.steps - self.last.steps
        d_prompt = now.prompt_tokens - self.last.prompt_tokens
        d_gen = now.generated_tokens - self.last.generated_tokens
        d_pre = now.preemptions - self.last.preemptions
        d_verify = now.verify_steps - self.last.verify_steps
        d_accepted = now.accepted - self.last.accepted
        self.last_t, self.last = t, replace(now)
        if d_steps == 0:
            return None
        spec = ""
        if d_verify:  # NOTE: tokens emitted per verify step: accepted drafts + 1
            spec = f", spec accept length {(d_verify + d_accepted) / d_verify:.2f}"
        return (
            f"{d_steps / dt:.1f} steps/s, prompt {d_prompt / dt:.0f} tok/s, "
            f"generation {d_gen / dt:.0f} tok/s, running {running}, waiting {waiting}, "
            f"KV {100.0 * used_pages / max(1, total_pages):.1f}% of {total_pages} pages, "
            f"preempted {d_pre}{spec}"
        )
