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


class SpeculativeIndex:
    """block hash -> {worker_id: expiry}, entries live ``ttl_s`` seconds.

    Args:
        ttl_s: how long a recorded block counts as held (a few heartbeat/event intervals).
        max_entries: bound on (block, worker) entries; the oldest go first when it is hit.
        clock: monotonic seconds; injected by tests.
    """

    def __init__(self, ttl_s: float = 2.0, max_entries: int = 200_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if ttl_s < 0:
            raise ValueError(f"speculative TTL must be >= 0 seconds, got {ttl_s}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self._clock = clock
        self._holders: dict[bytes, dict[str, float]] = {}
        # NOTE: the TTL is constant and the clock monotonic, so expiries are appended in order and
        # the oldest entry is always at the left.
        self._order: deque[tuple[float, bytes, str]] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._order)

    def record(self, block_hashes: Sequence[bytes], worker_id: str) -> None:
        """The worker is expected to hold ``block_hashes`` for the next ``ttl_s`` seconds."""
        if not self.ttl_s or not block_hashes:
            return
        now = self._clock()
        expiry = now + self.ttl_s
        with self._lock:
            self._expire(now)
            for h in block_hashes:
                self._holders.setdefault(h, {})[worker_id] = expiry
                self._order.append((expiry, h, worker_id))
            while len(self._order) > self.max_entries:
                self._drop_oldest()

    def matches(self, block_hashes: Sequence[bytes]) -> dict[str, int]:
        """Per worker, how many leading blocks of the chain it speculatively holds (0s omitted)."""
        if not block_hashes:
            return {}
        now = self._clock()
        with self._lock:
            first = self._holders.get(block_hashes[0])
            if not first:
                return {}
            alive = {w for w, exp in first.items() if exp > now}
            out = dict.fromkeys(alive, 1)
            for h in block_hashes[1:]:
                holders = self._holders.get(h)
                if not holders:
                    break
                alive = {w for w in alive if holders.get(w, 0.0) > now}
                if not alive:
                    break
                for w in alive:
                    out[w] += 1
            return out

    def _expire(self, now: float) -> None:
        while self._order and self._order[0][0] <= now:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        expiry, h, worker = self._order.popleft()
        holders = self._holders.get(h)
        # NOTE: a later record of the same (block, worker) moved its expiry; only the entry that
        # carries the current expiry may remove it.
        if holders is not None and holders.get(worker) == expiry:
            del holders[worker]
            if not holders:
                del self._holders[h]
