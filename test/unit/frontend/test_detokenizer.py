"""Incremental detokenizer against `tokenizer.decode(all_ids)` on SmolLM2's real
byte-level BPE, with emoji / CJK / combining sequences whose UTF-8 bytes are
split across tokens; plus single-token bytes for logprobs."""

from __future__ import annotations

import random

import pytest

from gyrfalcon.frontend.detokenizer import (
    HARD_MAX_WINDOW_TOKENS,
    MAX_WINDOW_TOKENS,
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    TokenTexts,
)

TEXT = (
    "héllo 😀 世界 🇫🇷 done. 日本語のテキスト 👨\u200d👩\u200d👧 naïve café, "
    "∮ E⋅da = Q, n → ∞, ∑ f(i) ᚻᛖ ᚳᚹᚫᚦ 🏳️\u200d🌈 ok\n\tend"
)
SPECIAL_TEXT = "Hi<|im_end|> there<|im_start|>assistant\n😀"
CHUNKINGS = [1, 2, 3, 5, 7]
RANDOM_TRIALS = 40


def detokenize(tok, ids: list[int], sizes, prompt: list[int] = (), skip: bool = True):
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
    pieces, i = [], 0
    for size in sizes:
        if i >= len(ids):
            break
        pieces.append(d.feed(ids[i : i + size]))
        i += size
    assert i >= len(ids)
    pieces.append(d.flush())
    return pieces


def test_fixture_really_splits_characters_across_tokens(tokenizer):
    ids = tokenizer.encode(TEXT)
    partial = [i for i in ids if REPLACEMENT_CHAR in tokenizer.decode([i])]
    assert len(partial) > 10, "the test text must exercise split multi-byte characters"


@pytest.mark.parametrize("chunk", CHUNKINGS)
@pytest.mark.parametrize("with_prompt", [False, True])
def test_matches_full_decode_and_never_emits_partial_chars(tokenizer, chunk, with_prompt):
    ids = tokenizer.encode(TEXT)
    prompt = tokenizer.encode("User: say something\nAssistant:") if with_prompt else []
    pieces = detokenize(tokenizer, ids, [chunk] * len(ids), prompt)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    for piece in pieces:
        assert REPLACEMENT_CHAR not in piece


def test_random_chunking_of_a_long_sequence(tokenizer):
    ids = tokenizer.encode(TEXT * 4)  # long enough to slide the window many times
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    rng = random.Random(0)
    for _ in range(RANDOM_TRIALS):
        sizes = [rng.randint(1, 6) for _ in ids]
        pieces = detokenize(tokenizer, ids, sizes)
        assert "".join(pieces) == expected
        assert all(REPLACEMENT_CHAR not in p for p in pieces)


def test_emoji_is_emitted_exactly_when_its_last_byte_arrives(tokenizer):
    ids = tokenizer.encode("a😀")
    d = IncrementalDetokenizer(tokenizer)
    outs = [d.feed([t]) for t in ids]
    assert "".join(outs) == "a😀"
    assert outs[-1].endswith("😀")  # completed by the last token, not held longer
    assert all(REPLACEMENT_CHAR not in o for o in outs)


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    ids = tokenizer.encode(SPECIAL_TEXT)
    pieces = detokenize(tokenizer, ids, [1] * len(ids), skip=skip)
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in "".join(pieces)) is (not skip)


def test_unfinished_character_is_flushed_at_the_end(tokenizer):
    ids = tokenizer.encode("x😀")[:-1]  # drop the emoji's last byte token
    d = IncrementalDetokenizer(tokenizer)
    assert REPLACEMENT_CHAR not in "".join(d.feed([t]) for t in ids)
    tail = d.flush()
    assert tail.endswith(REPLACEMENT_CHAR)


def test_invalid_byte_run_is_released_and_window_stays_bounded(tokenizer):
    # A run of lone continuation bytes can never complete a character.
    lone = tokenizer.encode("😀")[-1]
    assert tokenizer.decode([lone]) == REPLACEMENT_CHAR
    ids = [lone] * (HARD_MAX_WINDOW_TOKENS * 2) + tokenizer.encode(" fine")
    d = IncrementalDetokenizer(tokenizer)
    pieces = [d.feed([t]) for t in ids] + [d.flush()]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert len(d._window) <= HARD_MAX_WINDOW_TOKENS + 1


def test_window_stays_small_on_clean_text(tokenizer):
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 20)
    d = IncrementalDetokenizer(tokenizer)
    for t in ids:
        d.feed([t])
        assert len(d._window) <= MAX_WINDOW_TOKENS + 1
    assert d.num_tokens == len(ids)


def test_prompt_ending_inside_a_character_is_not_reemitted(tokenizer):
    ids = tokenizer.encode("ab😀 cd")
    cut = next(
        i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith(REPLACEMENT_CHAR)
    )
    d = IncrementalDetokenizer(tokenizer, ids[:cut])
    text = "".join(d.feed([t]) for t in ids[cut:]) + d.flush()
    assert text == tokenizer.decode(ids[cut:])
    assert "ab" not in text


def test_token_bytes_reassemble_the_text(tokenizer):
    texts = TokenTexts(tokenizer)
    ids = tokenizer.encode(TEXT)
    assert b"".join(texts.bytes_of(t) for t in ids).decode("utf-8") == TEXT
    split = [t for t in ids if REPLACEMENT_CHAR in tokenizer.decode([t])]
    for t in split:  # partial characters keep their exact bytes
        raw = texts.bytes_of(t)
        assert raw and texts.text_of(t) == raw.decode("utf-8", errors="replace")
    space_word = tokenizer.encode(" hello")
    assert len(space_word) == 1 and texts.bytes_of(space_word[0]) == b" hello"


def test_special_token_bytes_are_their_text(tokenizer):
    texts = TokenTexts(tokenizer)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert texts.bytes_of(eos) == b"<|im_end|>"
    assert texts.text_of(eos) == "<|im_end|>"
