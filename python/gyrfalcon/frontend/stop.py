"""Stop-string matching over a stream of text deltas.

The matcher sees the generated text piece by piece (one detokenized delta per
engine output) and decides what may be shown to the client now:

- text that can no longer be part of any stop string is released at once;
- a tail that is a proper prefix of some stop string is held back until the
  next delta shows whether it completes a match;
- on a match, the text is truncated where the stop string begins (the stop
  string itself is never emitted) and the matcher is finished.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopStringMatcher:
    """Incremental matcher for one sequence; pure (no I/O, no tokenizer)."""

    def __init__(self, stop: Iterable[str]) -> None:
        # NOTE: an empty stop string would match before any text at all; callers
        # drop them during validation, and the matcher ignores them defensively.
        self._stops = sorted({s for s in stop if s}, key=len)
        # Every proper prefix of every stop string: the tails worth holding back.
        self._prefixes = {s[:i] for s in self._stops for i in range(1, len(s))}
        self._max_hold = max((len(s) - 1 for s in self._stops), default=0)
        self._held = ""
        self._matched = False

    @property
    def matched(self) -> bool:
        """True once a stop string was found; later input is ignored."""
        return self._matched

    @property
    def held(self) -> str:
        """Text received but not yet released (a possible stop-string prefix)."""
        return self._held

    def feed(self, delta: str) -> tuple[str, bool]:
        """Consume the next text delta.

        Returns (text safe to emit now, matched). When matched is True the
        returned text ends right before the earliest stop-string occurrence.
        """
        if self._matched:
            return "", True
        if not self._stops:
            return delta, False
        buf = self._held + delta
        # NOTE: the held tail never contains a complete stop string (it was
        # searched last time), so searching `buf` finds exactly the matches that
        # end inside the new delta, including ones that start in the held tail.
        cut = self._earliest_match(buf)
        if cut is not None:
            self._held = ""
            self._matched = True
            return buf[:cut], True
        hold = self._holdback_len(buf)
        self._held = buf[len(buf) - hold :]
        return buf[: len(buf) - hold], False

    def flush(self) -> str:
        """Release the held tail (the sequence ended without completing a match)."""
        out, self._held = self._held, ""
        return "" if self._matched else out

    def _earliest_match(self, buf: str) -> int | None:
        best: int | None = None
        for s in self._stops:
            i = buf.find(s)
            if i != -1 and (best is None or i < best):
                best = i
        return best

    def _holdback_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper stop-string prefix."""
        for k in range(min(len(buf), self._max_hold), 0, -1):
            if buf[-k:] in self._prefixes:
                return k
        return 0
