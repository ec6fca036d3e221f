"""The virtual clock's event queue (what happened to each request: kvmesh/replay/records.py)."""

from __future__ import annotations

import heapq
from collections.abc import Callable


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
