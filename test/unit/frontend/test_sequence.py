"""Per-choice output handling: hidden stop tokens, stop strings, final flushes."""

from __future__ import annotations

import pytest

from gyrfalcon.frontend.sequence import SequenceDecoder
from gyrfalcon.ipc.messages import PositionLogprobs, RequestOutput


def out(ids: list[int], done: int, finish: str | None = None, lps: bool = False) -> RequestOutput:
    logprobs = [PositionLogprobs(t, -0.1) for t in ids] if lps else None
    return RequestOutput(
        "r",
        ids,
        logprobs=logprobs,
        finish_reason=finish,
        num_prompt_tokens=3,
        num_output_tokens=done,
    )


def test_stop_token_is_counted_and_logged_but_not_rendered(tokenizer):
    ids = tokenizer.encode(" Paris")
    stop_id = tokenizer.encode(".")[0]  # an ordinary token used as a stop_token_id
    dec = SequenceDecoder(tokenizer, 0, [1, 2, 3])
    first = dec.feed(out(ids, len(ids), lps=True))
    last = dec.feed(out([stop_id], len(ids) + 1, "stop", lps=True))
    assert first.text + last.text == " Paris"
    # one logprob entry per counted token: the stop token keeps its entry
    assert last.finish_reason == "stop" and last.token_ids == [stop_id]
    assert last.logprobs == [PositionLogprobs(stop_id, -0.1)]
    assert last.num_output_tokens == len(ids) + 1
    assert dec.finished


def test_length_finish_flushes_held_stop_prefix(tokenizer):
    ids = tokenizer.encode("Hello wor")
    dec = SequenceDecoder(tokenizer, 0, [], stop=["world"])
    deltas = [dec.feed(out([t], i + 1)) for i, t in enumerate(ids[:-1])]
    deltas.append(dec.feed(out(ids[-1:], len(ids), "length")))
    assert "".join(d.text for d in deltas) == "Hello wor"
    assert deltas[-1].finish_reason == "length"


def test_stop_string_across_tokens_finishes_with_stop(tokenizer):
    ids = tokenizer.encode("The answer is 42. More text")
    dec = SequenceDecoder(tokenizer, 3, [], stop=["42."])
    texts = []
    for i, t in enumerate(ids):
        d = dec.feed(out([t], i + 1))
        texts.append(d.text)
        if d.finished:
            break
    assert d.finish_reason == "stop" and d.index == 3
    assert "".join(texts) == "The answer is "
    assert d.num_output_tokens < len(ids)
    with pytest.raises(RuntimeError):
        dec.feed(out([ids[-1]], len(ids)))


def test_abort_and_error_pass_through(tokenizer):
    dec = SequenceDecoder(tokenizer, 0, [])
    d = dec.feed(RequestOutput("r", [], finish_reason="error", error="boom"))
    assert (d.finish_reason, d.error) == ("error", "boom")
    dec = SequenceDecoder(tokenizer, 0, [])
    ids = tokenizer.encode("partial")
    d = dec.feed(out(ids, len(ids), "abort"))
    assert (d.finish_reason, d.text) == ("abort", "partial")


def test_fail_reports_tokens_seen(tokenizer):
    dec = SequenceDecoder(tokenizer, 1, [7, 8])
    dec.feed(out([10, 11], 2))
    d = dec.fail("lost")
    assert (d.finish_reason, d.error, d.num_output_tokens, d.num_prompt_tokens) == (
        "error",
        "lost",
        2,
        2,
    )
