"""kv-aware's record of the prompts it routes: which prefixes are hot, and what each worker was given.

A worker's queue says what it has to do now. Two things a prefix cache decides are not in it
(docs/router.md, "kv-aware: prefixes over time"):

- **Is a prefix hot?** A prefix whose requests outgrow the workers that hold it needs more copies;
  one that does not would only be duplicated. The record counts, per prefix, this router's requests
  in flight that share it, at the chain's anchor positions (blocks 1, 2, 4, ... and the last,
  ``anchor_positions``: a chained hash names its whole prefix). A prefix with ``n`` requests in
  flight, where every worker carries ``m`` on average, keeps ``n / m`` workers busy; more than it
  has holders, and a copy on another worker carries its load instead of duplicating it
  (:meth:`PrefixLoad.replicas`). The count follows the load: the prefix spreads as its
  requests grow and stops spreading as they fall.
- **What does a placement commit?** Requests that share a prefix follow the worker that holds it,
  so a prompt no worker holds, placed on a worker, brings that worker the requests that will share
  it later. The record sums, per worker, the prompt tokens it was sent to compute (the content it
  was given to hold: SGLang's router keeps the same as its per-worker tree), and how often a new
  prompt shares its first block with one seen before (:attr:`PrefixLoad.repeat_share`: zero when
  prompts never repeat, and a placement then commits nothing).

Everything is counted from this router's own requests (the policy's ``started`` / ``finished``
hooks, under its lock); several routers each count their share (a prefix's share of the requests
in flight, and each worker's share of the content, are the same in expectation at every router).

This module imports neither grpc nor redis.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

from kvmesh.contract.index_protocol import anchor_positions, anchors_of
from kvmesh.contract.limits import MAX_CHAIN_BLOCKS
from kvmesh.router.core.policies.base import rendezvous_weight

MAX_FAMILIES = 65_536
"""First blocks remembered to tell a repeating prompt family from a new one (oldest dropped first)."""
REPEAT_MEMORY = 0.99
"""Weight :attr:`PrefixLoad.repeat_share` keeps per request (~100 requests of memory)."""


class PrefixLoad:
    """Per prefix, this router's requests in flight; per worker, the prompt tokens it was given.
    Not thread-safe on its own: the policy calls it under its lock."""

    def __init__(self) -> None:
        self._anchors: dict[bytes, int] = {}
        """Anchor hash -> requests in flight whose prompt has that prefix."""
        self._requests: dict[int, tuple[bytes, ...]] = {}
        """Request serial -> its anchors."""
        self.total = 0
        """Requests in flight (this router's, with at least one full block)."""
        self._families: OrderedDict[bytes, None] = OrderedDict()
        """First blocks of recent prompts, least recent first."""
        self.repeat_share = 0.0
        """Share of recent prompts whose first block an earlier prompt had (forgetting average)."""
        self._given: dict[str, int] = {}
        """Worker -> prompt tokens it was sent to compute (neither cached nor loaded there)."""

    # -- the record -------------------------------------------------------------------------------
    def started(self, serial: int, chain: Sequence[bytes], worker_id: str, new_tokens: int) -> None:
        """A request with this chain went to ``worker_id`` to compute ``new_tokens`` of its prompt (a
        retry or a re-pick: :meth:`finished` first)."""
        self._given[worker_id] = self._given.get(worker_id, 0) + new_tokens
        if not chain or serial in self._requests:
            return
        anchors = anchors_of(chain[:MAX_CHAIN_BLOCKS])
        self._requests[serial] = anchors
        self.total += 1
        for a in anchors:
            self._anchors[a] = self._anchors.get(a, 0) + 1
        family = anchors[0]
        seen = family in self._families
        self.repeat_share = REPEAT_MEMORY * self.repeat_share + (1.0 - REPEAT_MEMORY) * seen
        self._families[family] = None
        self._families.move_to_end(family)
        if len(self._families) > MAX_FAMILIES:
            self._families.popitem(last=False)

    def finished(self, serial: int) -> None:
        anchors = self._requests.pop(serial, None)
        if anchors is None:
            return
        self.total -= 1
        for a in anchors:
            n = self._anchors[a] - 1
            if n:
                self._anchors[a] = n
            else:  # NOTE: bounded by what is in flight
                del self._anchors[a]

    # -- what the policy reads --------------------------------------------------------------------
    def given(self, worker_id: str) -> int:
        """Prompt tokens this router sent the worker to compute."""
        return self._given.get(worker_id, 0)

    def replicas(self, chain: Sequence[bytes], workers: Sequence[str], matched: Sequence[int]) -> list[float]:
        """Per candidate (``workers[i]`` holds ``matched[i]`` leading blocks), how its blocks count
        against the workers each prefix needs: > 0, that many blocks it lacks (and another candidate
        holds) belong to a prefix that needs a copy there; < 0, that many blocks it holds belong to
        a prefix that needs fewer holders than it has; 0, neither.

        A prefix with ``n`` requests in flight, where every worker carries ``m`` on average, keeps
        ``k = ceil(n / m)`` workers busy (at least one). With fewer than ``k`` holders, a copy on any
        other worker is load, not a duplicate (the score picks which worker takes it, the shared view
        keeps several routers from taking the same one at once). With more than ``k``, the holders
        past the first ``k`` by rendezvous weight of the prefix's hash (the same ones at every router)
        are surplus: the prefix folds back to the others as its load falls.

        NOTE: between the two a copy is priced as a duplicate. Its later hits are hits its holders
        would serve too (they carry the prefix's load): spreading its prefill over them (a copy of a
        prefix with ``n`` others in flight counted ``1 / (1 + n / (holders + 1))`` of a duplicate)
        made copies that only moved hits, and cost capacity in the simulator: multi-turn 16.87 ->
        16.45, shared-prefix on 32 workers 50.8 -> 48.9 (2026-11-27, docs/router.md).

        NOTE: counts exist at anchor positions only; the blocks between two anchors take the count of
        the longer prefix (it has no more requests in flight than the shorter ones).
        """
        n = len(matched)
        out = [0.0] * n
        longest = max(matched, default=0)
        if longest == 0 or n < 2:
            return out
        chain = chain[:MAX_CHAIN_BLOCKS]
        # NOTE: a worker carries at least one request: below that the fleet is idle.
        per_worker = max(1.0, (self.total + 1) / n)
        prev = -1
        for p in anchor_positions(len(chain)):
            if prev + 1 >= longest:
                break
            hi = min(p, longest - 1)  # blocks prev + 1 .. hi of this segment
            # NOTE: +1: the request being routed will be one of them (and of the total).
            inflight = self._anchors.get(chain[p], 0) + 1
            need = min(n, max(1, math.ceil(inflight / per_worker)))
            size = hi - prev
            holders = [i for i in range(n) if matched[i] > hi]
            if need > len(holders):
                for i in range(n):
                    if matched[i] <= hi:  # NOTE: any worker may take the copy; the score picks which
                        out[i] += size - max(0, matched[i] - (prev + 1))
            elif need < len(holders):
                key = chain[p]
                holders.sort(key=lambda i: -rendezvous_weight(key, workers[i]))
                for i in holders[need:]:
                    out[i] -= size
            prev = p
        return out
