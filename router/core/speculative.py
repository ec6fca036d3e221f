"""Short-lived guesses of which worker will hold a prompt's blocks, before its events land.

After the router sends a prompt to a worker it records the prompt's block hashes for that worker
with a short TTL. A same-prefix request that arrives before the worker has prefilled and published
its BlockStored events (a burst) then sees the first one's worker as a holder and follows it,
instead of scattering the prefix over the fleet. Consulted together with the index answer: the
router takes the max of the two per worker.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from itertools import repeat


class SpeculativeIndex:
    """Per worker, block hash -> expiry; entries live ``ttl_s`` seconds.

    Args:
        ttl_s: how long a recorded block counts as held (a few heartbeat/event intervals).
        max_entries: bound on (block, worker) entries; when a record passes it, the entries of the
            oldest records go, whole, until it holds again.
        clock: monotonic seconds; injected by tests and the simulator.

    NOTE: block hashes are chained and every record is a chain from the root, so a worker that
    holds a chain's block i (recorded with some prompt) was recorded with the same blocks 0..i-1,
    at that time or later: along a chain the expiries never increase. ``matches`` therefore finds a
    worker's leading run by bisection (O(log n) lookups, not one per block). Every removal keeps
    that order: expiry removes every entry at or below ``now``, and the ``max_entries`` bound removes
    every entry carrying the oldest expiry (all records sharing it, since equal clock values are
    routine: a burst is decided at one instant). Removing only some of them could leave a hole in
    the middle of a chain that the bisection would jump over.
    """

    def __init__(self, ttl_s: float = 2.0, max_entries: int = 200_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s < 0:
            raise ValueError(f"speculative TTL must be >= 0 seconds, got {ttl_s}")
        if max_entries < 1:
            raise ValueError(f"speculative max_entries must be >= 1, got {max_entries}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._by_worker: dict[str, dict[bytes, float]] = {}
        # NOTE: the TTL is constant and the clock monotonic, so records are appended in expiry
        # order; each is (expiry, worker, chain). A record whose entries a later one re-stamped
        # stays queued and removes nothing when it goes.
        self._records: deque[tuple[float, str, Sequence[bytes]]] = deque()
        self._count = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """(block, worker) entries held and not yet expired."""
        with self._lock:
            self._expire(self._clock())
            return self._count

    def record(self, block_hashes: Sequence[bytes], worker_id: str) -> None:
        """The worker is expected to hold ``block_hashes`` (a chain from the root) for ``ttl_s``."""
        if not self.ttl_s or not block_hashes:
            return
        # NOTE: a leading part of a chain is a chain: over the bound, keep the prefix.
        block_hashes = block_hashes[:self.max_entries]
        now = self._clock()
        expiry = now + self.ttl_s
        with self._lock:
            self._expire(now)
            held = self._by_worker.setdefault(worker_id, {})
            before = len(held)
            held.update(zip(block_hashes, repeat(expiry)))
            self._count += len(held) - before
            self._records.append((expiry, worker_id, block_hashes))
            while self._count > self.max_entries:
                self._drop_through(self._records[0][0])

    def forget(self, block_hashes: Sequence[bytes], worker_id: str) -> None:
        """The latest record of ``block_hashes`` for ``worker_id`` was wrong (the request went
        elsewhere): its entries go. Entries other records of the worker stamped at the same instant
        go with them (under-counting a few blocks is safe; a hole in a chain is not)."""
        if not self.ttl_s or not block_hashes:
            return
        with self._lock:
            held = self._by_worker.get(worker_id)
            if held is None:
                return
            expiry = held.get(block_hashes[0])
            if expiry is None:
                return
            before = len(held)
            for h in block_hashes[:self.max_entries]:
                if held.get(h) == expiry:
                    del held[h]
            self._count -= before - len(held)
            if not held:
                del self._by_worker[worker_id]

    def matches(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Per worker, how many leading blocks of the chain it speculatively holds (0s omitted)."""
        if not block_hashes:
            return {}
        now = self._clock()
        out: dict[str, int] = {}
        first = block_hashes[0]
        with self._lock:
            for worker, held in self._by_worker.items():
                if held.get(first, 0.0) <= now:
                    continue
                lo, hi = 1, len(block_hashes)  # lo blocks held for sure; is block hi - 1?
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if held.get(block_hashes[mid - 1], 0.0) > now:
                        lo = mid
                    else:
                        hi = mid - 1
                out[worker] = lo
        return out

    def _expire(self, now: float) -> None:
        if self._records and self._records[0][0] <= now:
            self._drop_through(now)

    def _drop_through(self, expiry: float) -> None:
        """Removes every record, and every entry, whose expiry is at or below ``expiry``."""
        records = self._records
        while records and records[0][0] <= expiry:
            rec_expiry, worker, chain = records.popleft()
            held = self._by_worker.get(worker)
            if held is None:  # an earlier record with the same expiry emptied it
                continue
            before = len(held)
            for h in chain:
                # NOTE: a later record of the same (block, worker) moved its expiry; only a record
                # that carries the current expiry may remove it.
                if held.get(h) == rec_expiry:
                    del held[h]
            self._count -= before - len(held)
            if not held:
                del self._by_worker[worker]
