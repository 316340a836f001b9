"""Stop-string matching over text deltas: spans, holding back, earliest match."""

from __future__ import annotations

import random

import pytest

from gyrfalcon.frontend.stop import StopStringMatcher


def feed_all(stops: list[str], deltas: list[str]) -> tuple[list[str], bool, str]:
    """Feed every delta; return (emitted pieces, matched, full visible text)."""
    m = StopStringMatcher(stops)
    pieces: list[str] = []
    matched = False
    for d in deltas:
        out, matched = m.feed(d)
        pieces.append(out)
        if matched:
            break
    if not matched:
        pieces.append(m.flush())
    return pieces, matched, "".join(pieces)


def test_no_stop_strings_passes_everything_through():
    pieces, matched, text = feed_all([], ["ab", "cd"])
    assert pieces == ["ab", "cd", ""] and not matched and text == "abcd"


def test_match_inside_one_delta_truncates_before_the_stop_string():
    _, matched, text = feed_all(["STOP"], ["hello STOP world"])
    assert matched and text == "hello "


@pytest.mark.parametrize(
    "deltas",
    [
        ["Hello wo", "rld!"],  # stop spans 2 deltas
        ["Hello w", "or", "ld!"],  # stop spans 3 deltas
        ["Hello ", "w", "o", "r", "l", "d", "!"],  # one character per delta
    ],
)
def test_stop_spanning_deltas(deltas: list[str]):
    pieces, matched, text = feed_all(["world"], deltas)
    assert matched
    assert text == "Hello "
    assert "w" not in "".join(pieces)  # the partial stop string was never released


def test_partial_prefix_is_held_then_released_when_it_does_not_match():
    m = StopStringMatcher(["</end>"])
    assert m.feed("a </e") == ("a ", False)
    assert m.held == "</e"
    assert m.feed("xtra") == ("</extra", False)
    assert m.held == ""
    assert m.feed(" </") == (" ", False)
    assert m.flush() == "</"


def test_hold_back_uses_the_longest_possible_prefix():
    m = StopStringMatcher(["abc", "bcd"])
    assert m.feed("xab") == ("x", False)  # "ab" may start "abc"
    assert m.feed("cd") == ("", True)  # "abc" completes at index 0 of the held text


def test_earliest_match_wins_among_several_stop_strings():
    _, matched, text = feed_all(["gamma", "beta", "alpha"], ["zero beta alpha gamma"])
    assert matched and text == "zero "


def test_earliest_match_when_the_earlier_one_started_in_a_previous_delta():
    _, matched, text = feed_all(["xyz", "z!"], ["12x", "yz!"])
    assert matched and text == "12"


def test_match_at_the_very_start():
    pieces, matched, text = feed_all(["Hi"], ["Hi there"])
    assert matched and text == "" and pieces == [""]


def test_match_at_start_across_deltas():
    _, matched, text = feed_all(["<stop>"], ["<st", "op> more"])
    assert matched and text == ""


def test_after_a_match_further_input_is_ignored():
    m = StopStringMatcher(["."])
    assert m.feed("one. two") == ("one", True)
    assert m.feed("three") == ("", True)
    assert m.flush() == ""


def test_repeated_char_prefix_overlap():
    # "aab" with input "aaab": the held "aa" must slide, not be dropped.
    _, matched, text = feed_all(["aab"], ["a", "a", "a", "b", "c"])
    assert matched and text == "a"


def test_empty_stop_strings_are_ignored():
    _, matched, text = feed_all(["", "zz"], ["abc"])
    assert not matched and text == "abc"


def test_unicode_stop_string():
    _, matched, text = feed_all(["世界"], ["你好", "世", "界!"])
    assert matched and text == "你好"


def test_match_that_ends_first_wins_over_one_that_starts_first():
    # "abc" starts first but "b" ends first: generation reaches "b" first.
    for deltas in (["xabc"], ["x", "a", "b", "c"], ["xa", "bc"]):
        _, matched, text = feed_all(["abc", "b"], deltas)
        assert matched and text == "xa"


def test_same_end_prefers_the_earliest_start():
    for deltas in (["xabc!"], ["xab", "c!"], list("xabc!")):
        _, matched, text = feed_all(["bc", "abc", "c"], deltas)
        assert matched and text == "x"


@pytest.mark.parametrize(
    ("stops", "text", "expected"),
    [
        (["aab"], "aaab", "a"),
        (["abab"], "ababab", ""),
        (["abab"], "abaababab", "aba"),
        (["aabaab"], "aabaabaab", ""),
        (["aabaaa"], "aabaabaaa", "aab"),
        (["ab", "abc"], "xabc", "x"),  # a stop that is a prefix of another
        (["abcd", "bc"], "abcd", "a"),
        (["👋🏽", "é"], "hi 👋👋🏽 é", "hi 👋"),
    ],
)
def test_overlapping_patterns_under_any_split(stops: list[str], text: str, expected: str):
    for deltas in ([text], list(text), [text[i : i + 2] for i in range(0, len(text), 2)]):
        _, matched, out = feed_all(stops, deltas)
        assert matched and out == expected


def test_stop_string_fed_one_character_at_a_time_is_held_whole():
    stop = "<|im_end|>"
    m = StopStringMatcher([stop])
    assert m.feed("ok") == ("ok", False)
    for i, ch in enumerate(stop[:-1]):
        assert m.feed(ch) == ("", False)
        assert m.held == stop[: i + 1]
    assert m.feed(stop[-1]) == ("", True)
    assert m.held == ""


def test_flush_after_a_partial_prefix_releases_it_and_resets():
    m = StopStringMatcher(["abc"])
    assert m.feed("xab") == ("x", False)
    assert m.flush() == "ab"
    assert m.held == "" and not m.matched


def test_long_self_overlapping_stop_string():
    stop = "a" * 1999 + "b"
    text = "a" * 3000 + "b" + "tail"
    m = StopStringMatcher([stop])
    out: list[str] = []
    for i in range(0, len(text), 3):
        piece, matched = m.feed(text[i : i + 3])
        out.append(piece)
        assert len(m.held) <= len(stop) - 1
        if matched:
            break
    assert matched and "".join(out) == "a" * 1001


# --- randomized equivalence against a whole-text reference ---------------------


def reference(stops: list[str], text: str) -> tuple[str, bool]:
    """The first stop string to end in `text` (ties: the longest); O(n^2), obviously right."""
    for end in range(1, len(text) + 1):
        hits = [len(s) for s in stops if s and text[:end].endswith(s)]
        if hits:
            return text[: end - max(hits)], True
    return text, False


def reference_hold(stops: list[str], text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    return max((k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def random_word(rng: random.Random, alphabet: str, max_len: int) -> str:
    return "".join(rng.choice(alphabet) for _ in range(rng.randint(0, max_len)))


def random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text) + 1)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("seed", range(4))
def test_random_splits_match_the_reference(seed: int):
    rng = random.Random(seed)
    for _ in range(500):
        alphabet = rng.choice(["a", "ab", "abc", "aé世"])
        stops = [random_word(rng, alphabet, 5) for _ in range(rng.randint(0, 4))]
        text = random_word(rng, alphabet, 25)
        want, want_matched = reference(stops, text)
        m = StopStringMatcher(stops)
        seen, released, matched = "", "", False
        for delta in random_split(rng, text):
            seen += delta
            out, matched = m.feed(delta)
            released += out
            if matched:
                break
            # Released + held is everything fed; the held tail is the longest
            # suffix that may still become a stop string.
            assert released + m.held == seen
            assert len(m.held) == reference_hold(stops, seen)
        if not matched:
            released += m.flush()
        assert (released, matched) == (want, want_matched), (stops, text)
