"""When the router skips the index: :class:`IndexBreaker`, on the injected clock (no wall clock)."""

from __future__ import annotations

from collections.abc import Callable


class IndexBreaker:
    """After a failed Lookup, the index is skipped for ``retry_s`` — unless it answered another call
    while the failed one waited: then it is late, not down.

    NOTE: without it a blackholed kv_service would add the full Lookup deadline to every request;
    with it, one request per ``retry_s`` pays the deadline while the others route by rendezvous.
    A kv_service that is only slow (a burst on a busy host: the router's own loop and the
    kv_service's queue both count against the deadline) keeps answering the other calls; opening
    the breaker on it switched the index off for every request of the next second, and three
    routers then piled a burst onto the prefix's holder (issue 35).
    """

    def __init__(self, retry_s: float, clock: Callable[[], float]) -> None:
        self.retry_s = retry_s
        self._clock = clock
        self._down_until = 0.0
        self._answered_at = float("-inf")

    def open(self) -> bool:
        return self._clock() < self._down_until

    def failed(self, sent_at: float | None = None) -> bool:
        """A call sent at ``sent_at`` got no answer. Opens the breaker and answers True unless the
        index answered another call since ``sent_at`` (None: opens it)."""
        if sent_at is not None and self._answered_at > sent_at:
            return False
        self._down_until = self._clock() + self.retry_s
        return True

    def answered(self) -> None:
        """A Lookup or a Reserve was answered."""
        self._answered_at = self._clock()
        self._down_until = 0.0
