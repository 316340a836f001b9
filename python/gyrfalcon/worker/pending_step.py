"""A launched step of the worker, until its sampled ids are on the host."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gyrfalcon.ipc.messages import RowResult, StepResult
from gyrfalcon.worker.logprobs import HostCopy, SampleOutput
from gyrfalcon.worker.sampler import RequestSamplingState, to_position_logprobs


@dataclass
class PendingStep:
    """A launched step: its results are complete once `copy` has landed on the host."""

    step_id: int
    dp_rank: int
    results: list[RowResult]
    sample_rows: list[int] = field(default_factory=list)  # indices into results
    states: list[RequestSamplingState] = field(default_factory=list)  # of the sample rows
    copy: HostCopy | None = None
    resolved: bool = False
    # K1 = 1 + the most drafts a row verifies: 1 = one sampled token per row; else the
    # copy holds accept lengths [S], emitted tokens [S, K1] and the token of each of
    # the N logit rows, whose logprobs it carries (`spec_verify.verify_sample`)
    width: int = 1
    logit_starts: list[int] = field(default_factory=list)  # first logit row of each
    kind: str = "eager"  # how it ran (step_stats.KINDS)
    span: Any = None  # its CUDA events (`StepStats.end`), when timing

    def done(self) -> bool:
        return self.copy is None or self.copy.done()

    def resolve(self) -> StepResult:
        """Wait for the sampled ids; record them in the requests' sampling state (once)."""
        if not self.resolved and self.copy is not None:
            out = self.copy.wait()
            if self.width == 1:
                self._record(out, [[t] for t in out.token_ids.tolist()], None)
            else:
                s, k1 = len(self.sample_rows), self.width
                flat = out.token_ids.tolist()
                accept, emitted = flat[:s], flat[s : s + s * k1]
                runs = [emitted[j * k1 : j * k1 + a + 1] for j, a in enumerate(accept)]
                per_logit_row = SampleOutput(
                    out.token_ids[s + s * k1 :], out.logprobs, out.top_ids, out.top_logprobs
                )
                self._record(per_logit_row, runs, accept)
        self.resolved = True
        return StepResult(self.step_id, self.results, self.dp_rank)

    def _record(self, out: SampleOutput, runs: list[list[int]], accept: list[int] | None) -> None:
        """Each sampling row's emitted run; logprobs from `out`'s rows (the sampling rows
        when accept is None, else the logit rows from `logit_starts`)."""
        results = [self.results[i] for i in self.sample_rows]
        for j, (state, result, emitted) in enumerate(zip(self.states, results, runs)):
            state.output_ids.extend(emitted)
            result.token_ids = emitted
            result.num_accepted = len(emitted) - 1
            k = state.params.logprobs
            if k is not None:
                first = j if accept is None else self.logit_starts[j]
                rows = range(first, first + len(emitted))
                result.logprobs = [to_position_logprobs(out, r, k) for r in rows]
