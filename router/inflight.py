"""The router's own view of the work it has sent to each worker and not seen finish.

Fresh for this router's traffic (a heartbeat never lags it) and blind to other routers; the
policy combines it with the worker's reported load (router/policy.py, ``queued_tokens``).

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


@dataclass(slots=True)
class Ticket:
    """One request's share of a worker's in-flight counters."""

    worker_id: str
    prefill_tokens: int
    prefilled: bool = False
    finished: bool = False


class InFlight:
    """Per worker: requests not finished, and uncached prompt tokens not yet prefilled."""

    def __init__(self) -> None:
        self._requests: dict[str, int] = {}
        self._prefill: dict[str, int] = {}
        self._lock = threading.Lock()

    def start(self, worker_id: str, prefill_tokens: int) -> Ticket:
        with self._lock:
            self._requests[worker_id] = self._requests.get(worker_id, 0) + 1
            self._prefill[worker_id] = self._prefill.get(worker_id, 0) + prefill_tokens
        return Ticket(worker_id, prefill_tokens)

    def prefilled(self, t: Ticket) -> None:
        """The first token arrived: the prompt no longer waits for prefill."""
        with self._lock:
            if not t.prefilled and not t.finished:
                t.prefilled = True
                self._prefill[t.worker_id] -= t.prefill_tokens

    def finish(self, t: Ticket) -> None:
        """Idempotent; call it on every exit path."""
        self.prefilled(t)
        with self._lock:
            if t.finished:
                return
            t.finished = True
            n = self._requests[t.worker_id] - 1
            if n:
                self._requests[t.worker_id] = n
            else:  # NOTE: no entry for idle workers, so the maps stay bounded by busy workers
                del self._requests[t.worker_id]
                del self._prefill[t.worker_id]

    def view(self, worker_id: str) -> tuple[int, int]:
        """(requests, prefill_tokens) in flight on the worker."""
        with self._lock:
            return self._requests.get(worker_id, 0), self._prefill.get(worker_id, 0)
