"""The router's own view of the work it has sent to each worker and not seen finish.

Fresh for this router's traffic (a heartbeat never lags it) and blind to other routers; the
policy combines it with the worker's reported load (router/core/policies/, ``queued_tokens``).

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

RESERVATION_HORIZON_S = 1.0
"""A settled reservation older than this, counted from the Lookup asking, is in the kv_service's answer."""


@dataclass(slots=True)
class Ticket:
    """One request's share of a worker's in-flight counters."""

    worker_id: str
    prefill_tokens: int
    blocks: int = 0
    prefilled: bool = False
    finished: bool = False
    serial: int = 0
    """Unique among this router's tickets: what a policy keys its own per-request state by."""
    reserving: bool = False
    """Its pick is being reserved in the kv_service (the shared router view)."""
    reserved_at: float | None = None
    """When its reservation was settled (the router's clock); None = never reserved or still reserving."""


@dataclass(slots=True, frozen=True)
class WorkerInFlight:
    """This router's work on one worker."""

    requests: int = 0
    """Sent and not finished."""
    prefill_tokens: int = 0
    """Uncached prompt tokens of those not yet past their first token."""
    waiting: int = 0
    """Requests not yet past their first token."""
    blocks: int = 0
    """KV blocks their prompts take (the worker holds them while they run)."""


class InFlight:
    """Per worker: requests not finished, their blocks, and those (and their uncached prompt
    tokens) not yet prefilled."""

    def __init__(self) -> None:
        # worker -> [requests, prefill tokens, waiting requests, blocks]
        self._w: dict[str, list[int]] = {}
        self._lock = threading.Lock()
        self._serials = itertools.count(1)
        # worker -> its reserved tickets not finished, oldest reservation first (the shared view's own part)
        self._reserved: dict[str, list[Ticket]] = {}

    def start(self, worker_id: str, prefill_tokens: int, blocks: int = 0) -> Ticket:
        with self._lock:
            c = self._w.setdefault(worker_id, [0, 0, 0, 0])
            c[0] += 1
            c[1] += prefill_tokens
            c[2] += 1
            c[3] += blocks
            serial = next(self._serials)
        return Ticket(worker_id, prefill_tokens, blocks, serial=serial)

    def prefilled(self, t: Ticket) -> bool:
        """The first token arrived: the prompt no longer waits for prefill. True the first time."""
        with self._lock:
            if t.prefilled or t.finished:
                return False
            t.prefilled = True
            c = self._w[t.worker_id]
            c[1] -= t.prefill_tokens
            c[2] -= 1
            return True

    def finish(self, t: Ticket) -> bool:
        """Idempotent; call it on every exit path. True the first time."""
        self.prefilled(t)
        with self._lock:
            if t.finished:
                return False
            t.finished = True
            c = self._w[t.worker_id]
            c[0] -= 1
            c[3] -= t.blocks
            if not c[0]:  # NOTE: no entry for idle workers, so the map stays bounded by busy workers
                del self._w[t.worker_id]
            return True

    def reservation_started(self, t: Ticket) -> None:
        """The ticket's pick is being reserved in the kv_service."""
        with self._lock:
            if not t.reserving and not t.finished:
                t.reserving = True
                self._reserved.setdefault(t.worker_id, []).append(t)

    def reservation_settled(self, t: Ticket, now: float) -> None:
        """Its reservation was answered (or given up on) at ``now``."""
        with self._lock:
            t.reserving = False
            t.reserved_at = now

    def reserved_since(self, worker_id: str, since: float) -> tuple[int, int, int]:
        """(requests, uncached prompt tokens not yet prefilled, blocks) of this router's unfinished
        picks of the worker that a Lookup sent at ``since`` may not count yet: still being reserved,
        or reserved after it was sent. Older settled picks leave the list."""
        with self._lock:
            tickets = self._reserved.get(worker_id)
            if not tickets:
                return 0, 0, 0
            keep = [t for t in tickets if not t.finished and (t.reserving or t.reserved_at >= since - RESERVATION_HORIZON_S)]
            n = p = b = 0
            for t in keep:
                if t.reserving or t.reserved_at >= since:
                    n += 1
                    p += 0 if t.prefilled else t.prefill_tokens
                    b += t.blocks
            if keep:
                self._reserved[worker_id] = keep
            else:
                del self._reserved[worker_id]
            return n, p, b

    def view(self, worker_id: str) -> tuple[int, int]:
        """(requests, prefill_tokens) in flight on the worker."""
        with self._lock:
            c = self._w.get(worker_id)
            return (c[0], c[1]) if c else (0, 0)

    def of(self, worker_id: str) -> WorkerInFlight:
        """Every counter of the worker."""
        with self._lock:
            c = self._w.get(worker_id)
            return WorkerInFlight(*c) if c else WorkerInFlight()
