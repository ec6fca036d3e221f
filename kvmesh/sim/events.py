"""The virtual clock's event queue, and the record of what happened to each request."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request (client view, virtual seconds)."""

    index: int
    arrival: float
    prompt_len: int
    output_len: int
    worker: str = ""
    first_token: float | None = None
    finish: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    failed: str = ""
    attempts: int = 0
    slo_ok: bool | None = None
    counted_miss: bool = False
    """Already counted as an SLO miss (its TTFT deadline passed before its first token)."""
    pulled_tokens: int = 0
    """Prompt tokens whose KV a decode leg took in from a prefill worker (no cache hit: computed for it)."""
    last_token: float | None = None
    max_itl: float = 0.0
    """The longest gap between two of its tokens (a multi-step window's tokens spread evenly over it)."""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.finish is None or self.completion_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.completion_tokens - 1)


class EventQueue:
    """Events in (time, insertion) order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._n = 0

    def at(self, t: float, fn: Callable, *args) -> None:
        self._n += 1
        heapq.heappush(self._heap, (t, self._n, fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        self.at(self.now + dt, fn, *args)

    def pop(self) -> bool:
        if not self._heap:
            return False
        t, _, fn, args = heapq.heappop(self._heap)
        self.now = t
        fn(*args)
        return True

    def __len__(self) -> int:
        return len(self._heap)
