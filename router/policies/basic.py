"""The plain policies: round robin, least loaded, and prefix hashing (rendezvous, no index).

This module imports neither grpc nor redis.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.router.policies.base import Candidate, Decision, PolicyConfig, RouteQuery, RouterPolicy


class RoundRobinPolicy(RouterPolicy):
    """Each request to the next worker in worker-id order, from a random start; ignores cache and load."""

    name = "round-robin"

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


class PrefixHashPolicy(RouterPolicy):
    """Consistent (rendezvous) hashing of the leading blocks, bounded by load; no index."""

    name = "prefix-hash"

    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        return self.rendezvous(query, candidates, "prefix_hash")
