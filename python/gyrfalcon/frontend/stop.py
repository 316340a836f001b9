"""Stop-string matching over a stream of text deltas.

The matcher sees the generated text piece by piece (one detokenized delta per
engine output) and decides what may be shown to the client now:

- text that can no longer be part of any stop string is released at once;
- a tail that is a proper prefix of some stop string is held back until the
  next delta shows whether it completes a match;
- on a match, the text is truncated where the stop string begins (the stop
  string itself is never emitted) and the matcher is finished.

The match chosen is the one that *ends* first in the stream (the one
token-by-token generation reaches first); among matches ending at the same
character, the one starting earliest (the longest). So the released text does
not depend on how the stream is split into deltas.

Each stop string runs its own incremental KMP automaton: O(L) to build for a
stop string of length L, then amortized O(1) per stop string per character fed.
"""

from __future__ import annotations

from collections.abc import Iterable


def _borders(s: str) -> list[int]:
    """KMP failure table: border[i] = longest proper prefix of s that is a suffix of s[: i + 1]."""
    border = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = border[k - 1]
        if s[i] == s[k]:
            k += 1
        border[i] = k
    return border


class StopStringMatcher:
    """Incremental matcher for one sequence; pure (no I/O, no tokenizer)."""

    def __init__(self, stop: Iterable[str]) -> None:
        # NOTE: an empty stop string would match before any text at all; callers
        # drop them during validation, and the matcher ignores them defensively.
        self._stops = sorted({s for s in stop if s})
        self._borders = [_borders(s) for s in self._stops]
        # NOTE: invariant: _states[j] = longest suffix of the text seen so far
        # that is a prefix of _stops[j] (< its length until a match). The held
        # tail is the longest of these suffixes, so it equals
        # _stops[_src][:_hold] and is never stored as a string of its own.
        self._states = [0] * len(self._stops)
        self._hold = 0
        self._src = 0
        self._matched = False

    @property
    def active(self) -> bool:
        """Whether there are stop strings to look for."""
        return bool(self._stops)

    @property
    def matched(self) -> bool:
        """True once a stop string was found; later input is ignored."""
        return self._matched

    @property
    def held(self) -> str:
        """Text received but not yet released (a possible stop-string prefix)."""
        return self._stops[self._src][: self._hold] if self._hold else ""

    def feed(self, delta: str) -> tuple[str, bool]:
        """Consume the next text delta.

        Returns (text safe to emit now, matched). When matched is True the
        returned text ends right before the stop string that ends first (ties:
        the one starting earliest), and the matcher is finished.
        """
        if self._matched:
            return "", True
        if not self._stops:
            return delta, False
        # Positions below index into buf = held + delta (never materialized).
        best: tuple[int, int] | None = None  # (end in delta, -stop length): min wins
        hold, src = 0, 0
        for j, s in enumerate(self._stops):
            end = self._advance(j, delta)
            if end >= 0:
                best = min(best or (end, -len(s)), (end, -len(s)))
            elif self._states[j] > hold:
                hold, src = self._states[j], j
        if best is not None:
            # NOTE: a match that began before this delta was then a suffix of
            # the text and a prefix of its stop string, so no longer than
            # _hold: it starts inside buf and the cut below is >= 0.
            end, neg_len = best
            out = self._buf_prefix(delta, self._hold + end + neg_len)
            self._matched, self._hold = True, 0
            return out, True
        out = self._buf_prefix(delta, self._hold + len(delta) - hold)
        self._hold, self._src = hold, src
        return out, False

    def flush(self) -> str:
        """Release the held tail (the sequence ended without completing a match)."""
        out = self.held
        self._hold, self._states = 0, [0] * len(self._stops)
        return "" if self._matched else out

    def _advance(self, j: int, delta: str) -> int:
        """Run stop j's automaton over delta up to its first match; the index in
        delta just past that match, or -1 (then the state covers all of delta)."""
        s, border, k = self._stops[j], self._borders[j], self._states[j]
        i = 0
        while i < len(delta):
            if k == 0:
                # Fast path: in the start state only s[0] moves the automaton.
                i = delta.find(s[0], i)
                if i == -1:
                    break
            ch = delta[i]
            # NOTE: each fallback shrinks k and each character grows it by at
            # most one, so the while loop is amortized O(1) per character.
            while k and s[k] != ch:
                k = border[k - 1]
            if s[k] == ch:
                k += 1
                if k == len(s):
                    self._states[j] = k
                    return i + 1
            i += 1
        self._states[j] = k
        return -1

    def _buf_prefix(self, delta: str, n: int) -> str:
        """The first n characters of held + delta, in O(n)."""
        if n <= self._hold:
            return self._stops[self._src][:n]
        return self._stops[self._src][: self._hold] + delta[: n - self._hold]
