"""One generated choice: engine outputs in, client-visible deltas out.

`SequenceDecoder` applies, per output, the rules every endpoint shares:
a token-based stop (eos or `stop_token_ids`) is counted and keeps its logprob
entry but its text is not rendered, text goes through the incremental
detokenizer and then the stop-string matcher, and the held-back text is
released when the sequence ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gyrfalcon.frontend.detokenizer import IncrementalDetokenizer
from gyrfalcon.frontend.engine_client import FINISH_ERROR
from gyrfalcon.frontend.stop import StopStringMatcher
from gyrfalcon.ipc.messages import PositionLogprobs, RequestOutput

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

FINISH_STOP = "stop"


@dataclass
class ChoiceDelta:
    """What one engine output changed in one choice.

    `token_ids`/`logprobs` are every token of this output, a final stop token
    included (one logprob entry per counted token, as OpenAI and vLLM report
    them); `text` is what may be shown now: never a stop token's text, and it
    can lag the tokens (held-back stop-string prefixes, unfinished characters).
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    error_status: int = 0  # RequestOutput.error_status
    num_verify_steps: int = 0  # speculative decoding, so far (`RequestOutput`)
    num_accepted: int = 0
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SequenceDecoder:
    """Turns the outputs of one engine request into `ChoiceDelta`s."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        index: int,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self.index = index
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
        self._stop = StopStringMatcher(stop)
        self._num_prompt_tokens = len(prompt_ids)
        # NOTE: as in vLLM, the text of the first min_tokens tokens is not searched
        # for stop strings; matching starts with the text of the tokens after them.
        self._unmatched_tokens = min_tokens
        self._finished = False

    @property
    def finished(self) -> bool:
        return self._finished

    def feed(self, out: RequestOutput) -> ChoiceDelta:
        """Process one output. A delta with `finish_reason` "stop" from a stop
        string arrives while the engine request still runs: the caller aborts it.
        """
        if self._finished:
            raise RuntimeError(f"choice {self.index} already finished")
        ids, logprobs = out.token_ids, out.logprobs
        rendered = ids
        if out.finish_reason == FINISH_STOP and ids:
            # NOTE: the engine's contract: on a token stop (eos / stop_token_ids)
            # the last id of the final output is that token: counted and kept
            # in the logprobs, but not rendered.
            rendered = ids[:-1]
        ended = out.finish_reason is not None
        # NOTE: an output of several tokens (speculative decoding) is matched token by
        # token: a stop string ends the choice at the token that completes it, and the
        # tokens after it are neither counted nor reported, as without speculation.
        step = 1 if self._stop.active and len(rendered) > 1 else max(1, len(rendered))
        text, kept, matched = "", len(ids), False
        for start in range(0, max(1, len(rendered)), step):
            chunk = rendered[start : start + step]
            piece, matched = self._text(chunk, ended and start + step >= len(rendered))
            text += piece
            if matched:
                kept = start + len(chunk)
                break
        num_output = out.num_output_tokens - (len(ids) - kept)
        ids = ids[:kept]
        logprobs = logprobs[:kept] if logprobs is not None else None
        finish_reason = out.finish_reason
        if matched:
            finish_reason = FINISH_STOP
        elif ended:
            text += self._stop.flush()
        self._finished = finish_reason is not None
        return ChoiceDelta(
            index=self.index,
            text=text,
            token_ids=list(ids),
            logprobs=list(logprobs) if logprobs is not None else None,
            prompt_logprobs=out.prompt_logprobs,
            finish_reason=finish_reason,
            num_prompt_tokens=out.num_prompt_tokens or self._num_prompt_tokens,
            num_output_tokens=num_output,
            num_verify_steps=out.num_verify_steps,
            num_accepted=out.num_accepted,
            num_cached_tokens=out.num_cached_tokens,
            error=out.error if out.finish_reason == FINISH_ERROR else None,
            error_status=out.error_status,
        )

    def _text(self, ids: list[int], ended: bool) -> tuple[str, bool]:
        """Text the tokens `ids` make visible, and whether a stop string matched."""
        free = min(self._unmatched_tokens, len(ids))
        self._unmatched_tokens -= free
        text = self._detok.feed(ids[:free])  # before min_tokens: never a stop string
        tail = self._detok.feed(ids[free:])
        if ended:
            tail += self._detok.flush()
        tail, matched = self._stop.feed(tail)
        return text + tail, matched

    def fail(self, message: str) -> ChoiceDelta:
        """A final error delta for a failure outside the engine's outputs."""
        self._finished = True
        return ChoiceDelta(
            index=self.index,
            finish_reason=FINISH_ERROR,
            error=message,
            num_prompt_tokens=self._num_prompt_tokens,
            num_output_tokens=self._detok.num_tokens,
        )
