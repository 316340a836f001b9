"""Stop-string matching over text deltas: spans, holding back, earliest match."""

from __future__ import annotations

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
