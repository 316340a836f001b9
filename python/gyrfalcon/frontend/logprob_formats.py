"""Logprobs in the API's shapes: OpenAI's chat and legacy completions formats and
vLLM's `prompt_logprobs`, built from the engine's `PositionLogprobs`.

Every shape holds one entry per counted token (see docs/api.md); values are
clamped into JSON numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from gyrfalcon.frontend.protocol_responses import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
)
from gyrfalcon.ipc.messages import PositionLogprobs

if TYPE_CHECKING:
    from gyrfalcon.frontend.serving_common import ServingContext

# JSON has no -inf: a token with zero probability reports this (as OpenAI does).
MIN_LOGPROB = -9999.0


def finite_logprob(logprob: float) -> float:
    """`logprob` clamped into JSON-representable numbers (-inf and NaN -> MIN_LOGPROB)."""
    if math.isnan(logprob) or logprob < MIN_LOGPROB:
        return MIN_LOGPROB
    return logprob


def chat_logprobs(ctx: ServingContext, positions: Sequence[PositionLogprobs]) -> ChatChoiceLogprobs:
    """OpenAI's chat shape: one entry per token, each with its top alternatives."""
    texts = ctx.token_texts

    return ChatChoiceLogprobs(
        content=[
            ChatTokenLogprob(
                token=texts.text_of(p.token_id),
                logprob=finite_logprob(p.logprob),
                bytes=list(texts.bytes_of(p.token_id)),
                top_logprobs=[
                    ChatTopLogprob(
                        token=texts.text_of(t.token_id),
                        logprob=finite_logprob(t.logprob),
                        bytes=list(texts.bytes_of(t.token_id)),
                    )
                    for t in p.top
                ],
            )
            for p in positions
        ]
    )


class CompletionLogprobsBuilder:
    """Builds OpenAI's legacy logprobs shape (top `k` + the chosen token per
    position), keeping `text_offset` running."""

    def __init__(self, ctx: ServingContext, k: int) -> None:
        self._texts = ctx.token_texts
        self._k = k
        self.offset = 0

    def build(
        self,
        prompt_ids: Sequence[int] = (),
        prompt_logprobs: Sequence[PositionLogprobs | None] | None = None,
        positions: Sequence[PositionLogprobs] = (),
    ) -> CompletionLogprobs:
        out = CompletionLogprobs()
        for j, token_id in enumerate(prompt_ids):
            entry = (
                prompt_logprobs[j]
                if prompt_logprobs is not None and j < len(prompt_logprobs)
                else None
            )
            self._add(out, token_id, entry)
        for p in positions:
            self._add(out, p.token_id, p)
        return out

    def _add(self, out: CompletionLogprobs, token_id: int, entry: PositionLogprobs | None) -> None:
        token = self._texts.text_of(token_id)
        out.tokens.append(token)
        out.text_offset.append(self.offset)
        self.offset += len(token)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            return
        out.token_logprobs.append(finite_logprob(entry.logprob))
        top = {
            self._texts.text_of(t.token_id): finite_logprob(t.logprob) for t in entry.top[: self._k]
        }
        # NOTE: OpenAI: "the API will always return the logprob of the sampled token,
        # so there may be up to logprobs+1 elements" (one entry for `logprobs: 0`).
        top.setdefault(token, finite_logprob(entry.logprob))
        out.top_logprobs.append(top)


def vllm_prompt_logprobs(
    ctx: ServingContext,
    prompt_ids: Sequence[int],
    entries: Sequence[PositionLogprobs | None] | None,
    k: int,
) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: per position the prompt token (with its rank) and
    the top k tokens (ranks 1..k); the first position has none."""
    texts = ctx.token_texts
    out: PromptLogprobs = []
    for j in range(len(prompt_ids)):
        entry = entries[j] if entries is not None and j < len(entries) else None
        if entry is None:
            out.append(None)
            continue
        by_id = {
            t.token_id: PromptLogprob(
                logprob=finite_logprob(t.logprob),
                rank=r + 1,
                decoded_token=texts.text_of(t.token_id),
            )
            for r, t in enumerate(entry.top[:k])
        }
        by_id.setdefault(
            entry.token_id,
            PromptLogprob(
                logprob=finite_logprob(entry.logprob),
                rank=entry.rank,
                decoded_token=texts.text_of(entry.token_id),
            ),
        )
        out.append(by_id)
    return out
