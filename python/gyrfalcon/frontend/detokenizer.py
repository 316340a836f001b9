"""Incremental detokenization: token ids in, text deltas out.

`IncrementalDetokenizer` turns the growing token sequence of one generation into
text pieces whose concatenation equals `tokenizer.decode(all_ids)`. It decodes
a short sliding window of recent tokens instead of the whole sequence, so a
step costs O(window), not O(sequence).

`TokenTexts` gives the exact bytes and display string of single tokens, for
logprobs responses.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"
# An unfinished UTF-8 character has at most 3 of its bytes, and a decoder turns
# them into at most one U+FFFD per byte: at most this many trailing U+FFFD can
# still change into a real character when more tokens arrive.
UTF8_MAX_INCOMPLETE_BYTES = 3
# Tokens kept as decoding context when the window slides. NOTE: the window only
# slides at a clean point (decoded text ends in a complete character), so the
# context's text is wholly emitted; a cut inside a character merely renders
# as leading U+FFFD that every later decoding of the window shares.
CONTEXT_TOKENS = 4
# The window slides back to CONTEXT_TOKENS at the first clean point past this.
MAX_WINDOW_TOKENS = 16
# Past this many tokens without a clean point the output is invalid UTF-8, not
# an unfinished character: the held U+FFFD are released and the window slides.
HARD_MAX_WINDOW_TOKENS = 4 * MAX_WINDOW_TOKENS


def _stable_len(text: str) -> int:
    """Length of the prefix of `text` that more tokens can no longer change."""
    trailing = len(text) - len(text.rstrip(REPLACEMENT_CHAR))
    return len(text) - min(trailing, UTF8_MAX_INCOMPLETE_BYTES)


class IncrementalDetokenizer:
    """Detokenizer of one generated sequence (one per choice; not thread-safe).

    The window holds recent token ids; `_emitted` counts the characters of
    decode(window) already returned. Invariant: decode(window + more) starts
    with decode(window)[:_emitted] for any continuation `more`, because only
    text before a possibly unfinished trailing character is ever counted.
    Sliding the window keeps a few tokens of context, so decoders that treat a
    string's first token specially (leading-space stripping) see the same
    prefix before and after new tokens.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._backend = _fast_backend(tokenizer)
        self._window: list[int] = list(prompt_ids[-CONTEXT_TOKENS:]) if prompt_ids else []
        context = self._decode(self._window)
        if context.endswith(REPLACEMENT_CHAR):
            # NOTE: the prompt ends inside a character; its bytes must not be
            # re-emitted as part of the completion, so decode without context.
            self._window, context = [], ""
        self._emitted = len(context)
        self._num_tokens = 0

    @property
    def num_tokens(self) -> int:
        """Generated tokens fed so far."""
        return self._num_tokens

    def feed(self, token_ids: Sequence[int]) -> str:
        """Add generated tokens; return the text that became final.

        Text ending in an unfinished multi-byte character is held until the
        character completes (or `flush()` is called): the result never ends in
        a U+FFFD that stands for a partial character.
        """
        if not token_ids:
            return ""
        self._window.extend(token_ids)
        self._num_tokens += len(token_ids)
        text = self._decode(self._window)
        forced = len(self._window) > HARD_MAX_WINDOW_TOKENS
        stable = len(text) if forced else _stable_len(text)
        delta = text[self._emitted : stable]
        self._emitted = max(self._emitted, stable)
        if (stable == len(text) and len(self._window) > MAX_WINDOW_TOKENS) or forced:
            self._window = self._window[-CONTEXT_TOKENS:]
            self._emitted = len(self._decode(self._window))
        return delta

    def flush(self) -> str:
        """Return everything still held (end of sequence), even a partial character."""
        text = self._decode(self._window)
        delta = text[self._emitted :]
        self._emitted = len(text)
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return self._backend.decode(list(ids), skip_special_tokens=self._skip_special)
        return self._tok.decode(ids, skip_special_tokens=self._skip_special)


def _fast_backend(tokenizer: PreTrainedTokenizerBase) -> Any | None:
    """The Rust `tokenizers.Tokenizer` when decoding through it equals
    `tokenizer.decode` (no Python-side clean-up), else None. About 3x faster."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    return backend


# ---------------------------------------------------------------- single tokens


def _byte_level_alphabet() -> dict[str, int]:
    """The reversible byte <-> printable-char map of byte-level BPE vocabularies.

    Printable Latin-1 bytes stand for themselves; the others (control chars,
    space, DEL, NBSP, soft hyphen) are shifted to code points from 256 upwards.
    """
    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)}
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SENTENCEPIECE_SPACE = "\u2581"


class TokenTexts:
    """Exact bytes and display strings of single tokens (cached per id)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self._tok = tokenizer
        # Added tokens (special or not) are stored verbatim, not byte-mapped.
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self._verbatim = set(added) | set(getattr(tokenizer, "all_special_ids", ()))
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._alphabet = _byte_level_alphabet() if self._byte_level else {}
        # NOTE: keyed by token id, so bounded by the vocabulary size.
        self._cache: dict[int, bytes] = {}

    def bytes_of(self, token_id: int) -> bytes:
        """The raw bytes this token contributes to the output."""
        cached = self._cache.get(token_id)
        if cached is None:
            cached = self._compute_bytes(token_id)
            self._cache[token_id] = cached
        return cached

    def text_of(self, token_id: int) -> str:
        """Display string; a partial UTF-8 character shows as U+FFFD."""
        return self.bytes_of(token_id).decode("utf-8", errors="replace")

    def _compute_bytes(self, token_id: int) -> bytes:
        piece = self._tok.convert_ids_to_tokens(token_id)
        if piece is None:
            return b""
        if token_id in self._verbatim:
            return piece.encode("utf-8")
        if self._byte_level and all(c in self._alphabet for c in piece):
            return bytes(self._alphabet[c] for c in piece)
        fallback = _BYTE_FALLBACK.match(piece)
        if fallback is not None:
            return bytes([int(fallback.group(1), 16)])
        text = self._tok.decode([token_id], skip_special_tokens=False)
        # SentencePiece drops the leading space of a string's first piece.
        if piece.startswith(_SENTENCEPIECE_SPACE) and not text.startswith(" "):
            text = " " + text
        return text.encode("utf-8")
