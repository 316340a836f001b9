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
import os
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
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


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """-inf in place where row r of `bitmask` refuses a token, for each batch row r of
    `rows` (xgrammar's kernel: Triton on CUDA, its own on the CPU); logits [bs, vocab]
    float32, bitmask [>= bs, words] int32 on the logits' device."""
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)


def warm_up_masks(vocab_size: int, device: torch.device) -> None:
    """Build the mask kernel's variants now (Triton specializes the row count on 1 and
    on multiples of 16), not at the first structured request."""
    for n in (1, 3, 16):
        logits = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
        bitmask = torch.full((n, xgr.get_bitmask_shape(1, vocab_size)[1]), -1, dtype=torch.int32)
        apply_bitmask(logits, bitmask.to(device), torch.arange(n, device=device))


class HostMasks:
    """The host bitmasks of successive steps: two buffers, used in turn, each refilled
    only once its last upload is done (an event), pinned on CUDA so that the upload
    does not wait. NOTE: a fresh [rows, words] tensor filled every step is a large
    host op that wakes torch's thread pool; its spinning threads then slowed
    xgrammar's own fills ~8x on nvidia-h100-x1 (benchmarks/NOTES.md)."""

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._events: list[Any] = [None, None]
        self._turn = 0

    def take(self, rows: int, vocab_size: int, device: torch.device) -> torch.Tensor:
        """A [rows, words] int32 host buffer to fill (its contents undefined)."""
        self._turn ^= 1
        event = self._events[self._turn]
        if event is not None:
            event.synchronize()
            self._events[self._turn] = None
        words = xgr.get_bitmask_shape(1, vocab_size)[1]
        buf = self._buffers[self._turn]
        if buf is None or buf.shape[0] < rows or buf.shape[1] != words:
            pinned = device.type == "cuda"
            buf = torch.empty(max(rows, 64), words, dtype=torch.int32, pin_memory=pinned)
            self._buffers[self._turn] = buf
        return buf[:rows]

    def upload(self, mask: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`mask` (from the last `take`) on `device`, without waiting on CUDA."""
        if device.type != "cuda":
            return mask.clone()
        out = mask.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[self._turn] = event
        return out


class GrammarState:
    """One request's matcher, and how much of its output it has consumed. The grammar
    compiles in the background (`WorkerGrammars`); the first use waits for it."""

    def __init__(self, compiled: Future[xgr.CompiledGrammar], stop_ids: tuple[int, ...]):
        self._compiled = compiled
        self._matcher: xgr.GrammarMatcher | None = None
        self.stop_ids = stop_ids
        self.consumed = 0  # output tokens accepted so far
        # unconstrained from now on: a token the grammar refused (never through the
        # masks), or a grammar the worker could not compile (the frontend built it)
        self.broken = False

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        assert self._resolved(), "the grammar did not compile"
        assert self._matcher is not None
        return self._matcher

    def _resolved(self) -> bool:
        """Whether the matcher is there (waiting for the compile the first time)."""
        if self._matcher is None and not self.broken:
            try:
                self._matcher = xgr.GrammarMatcher(self._compiled.result())
            except Exception as exc:  # NOTE: never the server's end: log, do not constrain
                logger.error("structured output: the grammar did not compile: %s", exc)
                self.broken = True
        return not self.broken

    def sync(self, output_ids: list[int]) -> None:
        """Accept the output tokens emitted since the last call."""
        if not self._resolved():
            self.consumed = len(output_ids)
            return
        for t in output_ids[self.consumed :]:
            if self.broken or self.matcher.is_terminated():
                continue  # NOTE: after the stop token: only stop tokens follow
            if not self.matcher.accept_token(t):
                self._refused(t)
        self.consumed = len(output_ids)

    def _refused(self, token: int) -> None:
        # NOTE: cannot happen through the masks; stop constraining, say so
        logger.error("structured output: the grammar refused emitted token %d", token)
        self.broken = True

    def fill(self, bitmask: torch.Tensor, row: int, prefix: list[int]) -> None:
        """Row `row` of `bitmask`: the tokens allowed after the consumed output and then
        `prefix` (up to its first token the grammar refuses)."""
        fill_masks(bitmask, [(row, self, prefix)])

    def _walk(self, prefix: list[int]) -> int:
        """Accept `prefix` up to its first refused token; how many were accepted."""
        if not self._resolved():
            return 0
        accepted = 0
        for t in prefix:
            if self.broken or self.matcher.is_terminated() or not self.matcher.accept_token(t):
                break
            accepted += 1
        return accepted


_BATCH: xgr.BatchGrammarMatcher | None = None


def _batch_matcher() -> xgr.BatchGrammarMatcher:
    """xgrammar's multithreaded filler, one per process (half the cores, at most 8)."""
    global _BATCH
    if _BATCH is None:
        _BATCH = xgr.BatchGrammarMatcher(max_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))
    return _BATCH


def sync_all(pairs: list[tuple[GrammarState, list[int]]]) -> None:
    """`state.sync(output_ids)` for each distinct state; one call into xgrammar for the
    states with one new token (a decode step's)."""
    one: list[GrammarState] = []
    tokens: list[int] = []
    for state, output_ids in pairs:
        live = state._resolved() and not state.matcher.is_terminated()
        if live and len(output_ids) == state.consumed + 1:
            one.append(state)
            tokens.append(output_ids[-1])
        else:
            state.sync(output_ids)
    if one:
        accepted = xgr.BatchGrammarMatcher.batch_accept_token([s.matcher for s in one], tokens)
        for state, ok, token in zip(one, accepted, tokens):
            state.consumed += 1
            if not ok:
                state._refused(token)


def fill_masks(bitmask: torch.Tensor, entries: list[tuple[int, GrammarState, list[int]]]) -> None:
    """For each (row, state, prefix): bitmask's row `row` = what `state` allows after
    its consumed output and then `prefix` (up to its first refused token); the states
    are left as they were. Distinct states fill in parallel (xgrammar's threads); a
    state met twice (a verify row's positions) fills one position at a time."""
    if len({id(s) for _, s, _ in entries}) < len(entries):
        for entry in entries:
            fill_masks(bitmask, [entry])
        return
    walked, live, rows = [], [], []
    for row, state, prefix in entries:
        walked.append((state, state._walk(prefix)))
        if state.broken:
            bitmask[row].fill_(-1)
        elif state.matcher.is_terminated():
            allow_only(bitmask, row, state.stop_ids)
        else:
            live.append(state.matcher)
            rows.append(row)
    if len(live) == 1:
        live[0].fill_next_token_bitmask(bitmask, rows[0])
    elif live:
        _batch_matcher().batch_fill_next_token_bitmask(live, bitmask, rows)
    for state, accepted in walked:
        if accepted:
            state.matcher.rollback(accepted)


class WorkerGrammars:
    """Compiles requests' grammars against the model's tokenizer (loaded on the first
    constrained request: ~1 s once), keeping the last COMPILED_CACHE compiled. Compiles
    run on a thread of their own (xgrammar releases the GIL), from the step that
    brings the request until its first sample needs the mask: a new schema does not
    stall the other rows' steps."""

    def __init__(self, tokenizer_path: str, vocab_size: int, stop_ids: tuple[int, ...]):
        self.tokenizer_path, self.vocab_size, self.stop_ids = tokenizer_path, vocab_size, stop_ids
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiled: OrderedDict[Any, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")

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
        """A fresh matcher for `so`, its grammar compiling (or compiled) meanwhile."""
        key = (so.kind, so.spec, so.strict)
        compiled = self._compiled.pop(key, None)
        if compiled is None:
            compiled = self._pool.submit(self._compile, so)
        self._compiled[key] = compiled
        while len(self._compiled) > COMPILED_CACHE:
            self._compiled.popitem(last=False)
        return GrammarState(compiled, self.stop_ids)

    def _compile(self, so: StructuredOutput) -> xgr.CompiledGrammar:
        return self.compiler().compile_grammar(build_grammar(so))
