"""Structured output on the worker: an xgrammar matcher per constrained request, and
the token bitmasks a step's sampling applies.

A request's matcher follows its output. Before a step samples the request's row, the
matcher consumes the tokens the request emitted since its last step (`sync`); like
penalties, a constrained row reads its output on the host, so the worker resolves
the earlier steps first. The bitmask of a sample position that follows d more tokens
(the drafts a verify row checks before it) comes from accepting those d tokens,
filling, and rolling them back (`fill`). A draft the grammar refuses ends that walk:
the positions after it repeat the refusing state's mask. The target's masked choice
at the refused draft's position cannot be that draft, so the draft is rejected there
and nothing after it is emitted: a draft that leaves the grammar is never emitted.

Once the grammar is complete the matcher allows only the stop tokens, and after one
of them (a request that ignores EOS) nothing but the stop tokens again.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

import torch
import xgrammar as xgr

from gyrfalcon.grammar.spec import build_grammar
from gyrfalcon.ipc.messages import StructuredOutput

logger = logging.getLogger(__name__)

# compiled grammars kept per worker (a service sees the same few schemas again and again)
COMPILED_CACHE = 64


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab / 32)] int32 on the host, every token allowed; bit b of word w
    allows token 32 w + b."""
    return torch.full((rows, xgr.get_bitmask_shape(1, vocab_size)[1]), -1, dtype=torch.int32)


def allow_only(bitmask: torch.Tensor, row: int, token_ids: tuple[int, ...]) -> None:
    """Row `row` of `bitmask` allowing exactly `token_ids`."""
    bitmask[row].zero_()
    for t in token_ids:
        word, bit = divmod(t, 32)
        value = int(bitmask[row, word]) & 0xFFFF_FFFF | (1 << bit)
        bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # int32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] bool from `bitmask` [rows, words] int32 (on its device, no sync)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    unpacked = (bitmask[:, :, None] >> bits) & 1  # [rows, words, 32]
    return unpacked.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


class GrammarState:
    """One request's matcher, and how much of its output it has consumed."""

    def __init__(self, compiled: xgr.CompiledGrammar, stop_ids: tuple[int, ...]):
        self.matcher = xgr.GrammarMatcher(compiled)
        self.stop_ids = stop_ids
        self.consumed = 0  # output tokens accepted so far
        self.broken = False  # an output token the grammar refused (never by construction)

    def sync(self, output_ids: list[int]) -> None:
        """Accept the output tokens emitted since the last call."""
        for t in output_ids[self.consumed :]:
            if self.broken or self.matcher.is_terminated():
                continue  # NOTE: after the stop token: only stop tokens follow
            if not self.matcher.accept_token(t):
                # NOTE: cannot happen through the masks; stop constraining, say so
                logger.error("structured output: the grammar refused emitted token %d", t)
                self.broken = True
        self.consumed = len(output_ids)

    def fill(self, bitmask: torch.Tensor, row: int, prefix: list[int]) -> None:
        """Row `row` of `bitmask`: the tokens allowed after the consumed output and then
        `prefix` (up to its first token the grammar refuses)."""
        if self.broken:
            bitmask[row].fill_(-1)
            return
        accepted = 0
        for t in prefix:
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                break
            accepted += 1
        if self.matcher.is_terminated():
            allow_only(bitmask, row, self.stop_ids)
        else:
            self.matcher.fill_next_token_bitmask(bitmask, row)
        if accepted:
            self.matcher.rollback(accepted)


class WorkerGrammars:
    """Compiles requests' grammars against the model's tokenizer (loaded on the first
    constrained request: ~1 s once), keeping the last COMPILED_CACHE compiled."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_ids: tuple[int, ...]):
        self.tokenizer_path, self.vocab_size, self.stop_ids = tokenizer_path, vocab_size, stop_ids
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[Any, xgr.CompiledGrammar] = OrderedDict()

    def compiler(self) -> xgr.GrammarCompiler:
        if self._compiler is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=self.vocab_size, stop_token_ids=list(self.stop_ids)
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def state(self, so: StructuredOutput) -> GrammarState:
        """A fresh matcher for `so` (GrammarError where the grammar is invalid)."""
        key = (so.kind, so.spec, so.strict)
        compiled = self._compiled.pop(key, None)
        if compiled is None:
            compiled = self.compiler().compile_grammar(build_grammar(so))
        self._compiled[key] = compiled
        while len(self._compiled) > COMPILED_CACHE:
            self._compiled.popitem(last=False)
        return GrammarState(compiled, self.stop_ids)
