"""The plain policies: round robin, least loaded, and SGLang's prefix hashing (no index).

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

from kvmesh.router.core.policies.base import Candidate, Decision, PolicyConfig, RouteQuery, RouterPolicy

VIRTUAL_NODES = 150
"""Points of each worker on the hash ring (SGLang's ``VIRTUAL_NODES_PER_WORKER``)."""


class RoundRobinPolicy(RouterPolicy):
    """Each request to the next worker in worker-id order, from a random start; ignores cache and load."""

    name = "round-robin"
    pick_records = True

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        # NOTE: a random start: several routers (or restarted ones) that all began at the first
        # worker would send the first requests of a burst, one from each router, to the same worker.
        self._next = self._rng.randrange(1 << 16)

    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        with self._lock:
            i = self._next % len(ordered)
            self._next += 1
        return Decision(ordered[i].worker_id, "round_robin", 0)


class LeastLoadedPolicy(RouterPolicy):
    """The worker with the least queued work (ties at random); ignores the cache."""

    name = "least-loaded"

    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        return self.least_loaded(candidates)


def ring_position(key: bytes) -> int:
    """A point on the ring: the first 8 bytes of a blake2b digest (SGLang: blake3), stable across processes."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


class HashRing:
    """Consistent hashing with virtual nodes: ``VIRTUAL_NODES`` points per worker; a key belongs to the
    first worker point at or after its own, clockwise. Rebuilt only when the worker set changes."""

    def __init__(self, worker_ids: Sequence[str] = ()) -> None:
        self.workers: frozenset[str] = frozenset(worker_ids)
        points = sorted((ring_position(f"{w}#{i}".encode()), w) for w in sorted(self.workers)
                        for i in range(VIRTUAL_NODES))
        self._positions = [p for p, _ in points]
        self._owners = [w for _, w in points]

    def owner(self, key: bytes) -> str | None:
        if not self._owners:
            return None
        i = bisect.bisect_left(self._positions, ring_position(key))
        return self._owners[i % len(self._owners)]


class PrefixHashPolicy(RouterPolicy):
    """SGLang's ``prefix_hash`` policy: a consistent-hash ring over the prompt's first 256 tokens,
    bounded by load. Follows sgl-project/sglang ``sgl-model-gateway/src/policies/prefix_hash.rs``
    @065f331fc8a7 (``find_worker_with_load_balance``, ``load_ok``) and the ring of
    ``sgl-model-gateway/src/core/worker_registry.rs`` (``HashRing``: 150 virtual nodes per worker,
    ``find_healthy_url``); no code copied.

    - key: the prompt's first ``prefix_tokens`` (256) tokens. Block hashes are chained, so the hash of
      block ``ceil(256 / block_size)`` names them (256 tokens at 16 or 64 tokens a block; the nearest
      whole block above otherwise); a shorter prompt is keyed by its last full block (SGLang hashes
      the whole prompt). A prompt without a full block goes to the least loaded worker;
    - load: this router's in-flight requests per worker (SGLang's router-side counter);
    - the ring's worker wins if its load <= ``load_factor`` x (total + 1) / n; else the least loaded of
      the workers within that bound (the first on ties: no ring walk, despite SGLang's comment).
    """

    name = "prefix-hash"
    prefix_tokens = 256
    load_factor = 1.25

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self._ring = HashRing()

    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        loads = [c.inflight_requests for c in candidates]
        least = loads.index(min(loads))
        if not query.block_hashes:
            return Decision(candidates[least].worker_id, "least_loaded", loads[least])
        n = -(-self.prefix_tokens // max(1, query.block_size))
        key = query.block_hashes[min(n, len(query.block_hashes)) - 1]
        ids = [c.worker_id for c in candidates]
        with self._lock:
            if self._ring.workers != frozenset(ids):
                self._ring = HashRing(ids)
            target = self._ring.owner(key)
        i = ids.index(target) if target is not None else least
        total = sum(loads)
        bound = self.load_factor * (total + 1) / len(loads)
        if total == 0 or loads[i] <= bound:
            return Decision(ids[i], "prefix_hash", loads[i])
        # NOTE: the least loaded worker is always within the bound (min <= mean < 1.25 (total + 1) / n),
        # so SGLang's "every worker overloaded: the ring's anyway" never happens; the first on ties.
        return Decision(ids[least], "load", loads[least])
