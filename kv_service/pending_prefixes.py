"""The prefixes the routers' reserved picks will hold: the routers' speculative maps, shared.

A router that sends a prompt to a worker expects that worker to hold the prompt's blocks once the
request is prefilled, before its BlockStored events reach the index; its own speculative map
(router/core/speculative.py) says so to its own next picks. Other routers did not know it: in a burst of
one prefix each router started its own copies, and three routers piled onto the prefix's holder
where one router spread the burst (issue 35; docs/router.md, "Several routers").

Each Reserve therefore carries a few **anchors** of the prompt's chain: the hashes of its blocks 1,
2, 4, 8, ... and of its last block (kvmesh/contract/index_protocol.py, ``anchor_positions``). Block hashes are chained, so a
queried chain whose block i equals an anchor shares the reserved prompt's first i + 1 blocks; a
Lookup checks its own chain at the same positions (O(log n) dict reads) and answers, per worker,
the longest prefix a pick reserved there will hold (``WorkerMatch.pending_blocks``). A prefix
between two powers of two is rounded down to the lower one (at most half of it unseen).

Anchors live ``ttl_ms`` (the speculative map's TTL: by then the worker's own events say what it
holds), or until the worker's events say it evicted that block from its device, and are bounded in
number, oldest first. No grpc, no redis; kept in the kv_service process
(one replica's picks; docs/router.md says what that means with several replicas).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence

from kvmesh.contract.index_protocol import anchor_positions


class PendingPrefixes:
    """anchor -> {worker: expiry}; ``match`` answers per worker the longest anchored prefix of a chain.

    Args:
        ttl_ms: how long a reserved pick's anchors count.
        max_entries: bound on (anchor, worker) entries; past it the oldest go.
    """

    def __init__(self, ttl_ms: int, max_entries: int = 200_000) -> None:
        self.ttl_ms = ttl_ms
        self.max_entries = max_entries
        self._held: dict[bytes, dict[str, int]] = {}
        self._order: deque[tuple[int, bytes, str]] = deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._order)

    def add(self, worker_id: str, anchors: Sequence[bytes], now_ms: int) -> None:
        """A pick of ``worker_id`` was reserved for a prompt with these anchors."""
        if not self.ttl_ms or not anchors:
            return
        expiry = now_ms + self.ttl_ms
        with self._lock:
            self._expire(now_ms)
            for a in anchors:
                self._held.setdefault(a, {})[worker_id] = expiry
                self._order.append((expiry, a, worker_id))
            while len(self._order) > self.max_entries:
                self._drop()

    def forget(self, worker_id: str, hashes: Sequence[bytes]) -> None:
        """``worker_id`` no longer holds these blocks (it evicted them): anchors among them stop counting
        for it (a block evicted is evicted after its descendants: the anchors past it went first)."""
        with self._lock:
            held = self._held
            for h in hashes:
                workers = held.get(h)
                if workers is not None and workers.pop(worker_id, None) is not None and not workers:
                    del held[h]

    def match(self, chain: Sequence[bytes], now_ms: int) -> dict[str, int]:
        """Per worker, the leading blocks of ``chain`` a reserved pick there will hold (0s omitted)."""
        out: dict[str, int] = {}
        if not self._held:
            return out
        with self._lock:
            for i in anchor_positions(len(chain)):
                workers = self._held.get(chain[i])
                if workers:
                    for w, expiry in workers.items():
                        if expiry > now_ms:
                            out[w] = i + 1  # NOTE: positions ascend: the last match is the longest
        return out

    def match_anchors(self, anchors: Sequence[bytes], now_ms: int) -> dict[str, int]:
        """Per worker, how many of ``anchors`` (a Reserve's, in chain order) lead a prefix reserved there."""
        out: dict[str, int] = {}
        if not self._held:
            return out
        with self._lock:
            for j, a in enumerate(anchors):
                workers = self._held.get(a)
                if workers:
                    for w, expiry in workers.items():
                        if expiry > now_ms:
                            out[w] = j + 1
        return out

    def _expire(self, now_ms: int) -> None:
        order = self._order
        while order and order[0][0] <= now_ms:
            self._drop()

    def _drop(self) -> None:
        expiry, anchor, worker = self._order.popleft()
        workers = self._held.get(anchor)
        # NOTE: a later add of the same (anchor, worker) moved its expiry: only that one removes it.
        if workers is not None and workers.get(worker) == expiry:
            del workers[worker]
            if not workers:
                del self._held[anchor]
