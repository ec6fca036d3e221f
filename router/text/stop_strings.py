"""Stop strings on a stream of text deltas, as vLLM's detokenizer applies them.

The worker stops on token ids only; strings are the router's job, because only the router turns
tokens into text. The first occurrence of any stop string ends the output: the text stops before
it (or after it, with ``include``). While streaming, text that could be the start of a stop string
is held back until the next delta shows whether it is one, so a client never receives text that a
stop string later takes back.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def check_stop_strings(stops: Sequence[str]) -> None:
    """Raises ValueError naming the bound a client's stop list breaks."""
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS}")
    for s in stops:
        if not s or len(s) > MAX_STOP_CHARS:
            raise ValueError(f"each stop string must have 1 to {MAX_STOP_CHARS} characters, got {len(s)}")


class StopStrings:
    """Args:
    stops: the stop strings (non-empty).
    include: keep the stop string at the end of the text (vLLM's ``include_stop_str_in_output``).
    """

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self.stops = list(stops)
        self.include = include
        self.matched: str | None = None
        """The stop string that ended the text, once one did."""
        self._held = ""

    def push(self, delta: str) -> str:
        """The text that is final now; after a match it is the text up to the stop, then "" forever."""
        if self.matched is not None:
            return ""
        buf = self._held + delta
        # NOTE: released text never ends with the start of a stop string, so a match can only
        # begin in the held part or the new delta: searching buf finds the first one overall.
        hit: tuple[int, str] | None = None
        for s in self.stops:
            i = buf.find(s)
            if i >= 0 and (hit is None or i < hit[0]):
                hit = (i, s)
        if hit is not None:
            i, s = hit
            self.matched = s
            self._held = ""
            return buf[: i + len(s)] if self.include else buf[:i]
        keep = self._partial_suffix(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The held text at the end of the stream (it turned out to start no stop string)."""
        rest, self._held = self._held, ""
        return rest if self.matched is None else ""

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:k]):
                    best = k
                    break
        return best
