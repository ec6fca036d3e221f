"""Where the core's counts go: :class:`DecisionObserver` (Prometheus in the live router, router/metrics.py;
plain counts in the simulator and the tests, :class:`CountingObserver`)."""

from __future__ import annotations

from typing import Protocol


class DecisionObserver(Protocol):
    """Where the core's counters go (Prometheus in the live router, plain counts in the simulator)."""

    def decision(self, policy: str, reason: str) -> None: ...

    def fallback(self, cause: str) -> None:
        """A request routed without the index: ``no_index``, ``lookup_failed`` or ``index_down``."""
        ...

    def lookup_latency(self, seconds: float) -> None: ...


class CountingObserver:
    """Counts decisions by reason and fallbacks by cause (the simulator's and the tests' observer)."""

    def __init__(self) -> None:
        self.decisions: dict[str, int] = {}
        self.fallbacks: dict[str, int] = {}
        self.lookups = 0

    def decision(self, policy: str, reason: str) -> None:
        self.decisions[reason] = self.decisions.get(reason, 0) + 1

    def fallback(self, cause: str) -> None:
        self.fallbacks[cause] = self.fallbacks.get(cause, 0) + 1

    def lookup_latency(self, seconds: float) -> None:
        self.lookups += 1
