"""The approx-tree policy: a router-local guess of every worker's prefix cache, no index, no events.

Like SGLang's cache-aware router, the router remembers which prompts it sent where and assumes the
worker still holds them; it never hears about evictions, so its picture drifts from the truth.
Block hashes are chained, so a set of hashes per worker *is* a prefix tree: a prompt's match on a
worker is the number of its leading hashes in that worker's set.

Per request (``pick``):
1. If the router's own in-flight counts are imbalanced (max - min > ``balance_abs_requests`` and
   max > ``balance_rel`` x min), the least busy worker wins ("balance").
2. Else the worker with the longest match wins when it covers more than ``cache_threshold`` of the
   prompt ("tree"); otherwise the worker with the smallest tree ("capacity"), which has the most
   room for a new prefix.
3. The prompt's blocks are inserted into the winner's set (most recent use); a set larger than the
   worker's block count (reported in its load, else ``default_capacity_blocks``) drops its least
   recently used hashes.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.contract.types import H100_8B_KV_BLOCKS
from kvmesh.router.policies.base import Candidate, Decision, PolicyConfig, RouteQuery, RouterPolicy


@dataclass(slots=True)
class ApproxTreeConfig:
    cache_threshold: float = 0.5
    """Share of the prompt a worker's tree must match to win on cache (SGLang's default 0.5)."""
    balance_abs_requests: int = 32
    """Imbalance: the busiest worker has this many more in-flight requests than the least busy ..."""
    balance_rel: float = 1.5
    """... and more than this times as many."""
    default_capacity_blocks: int = H100_8B_KV_BLOCKS
    """A worker's tree size when its load does not report its block count."""


class ApproxPrefixTree:
    """Per worker, the block hashes the router sent it, in LRU order. Not thread-safe."""

    def __init__(self) -> None:
        self._trees: dict[str, OrderedDict[bytes, None]] = {}

    def match(self, worker_id: str, chain: Sequence[bytes]) -> int:
        """Leading blocks of ``chain`` in the worker's tree."""
        tree = self._trees.get(worker_id)
        if not tree:
            return 0
        n = 0
        for h in chain:
            if h not in tree:
                break
            n += 1
        return n

    def size(self, worker_id: str) -> int:
        return len(self._trees.get(worker_id, ()))

    def insert(self, worker_id: str, chain: Sequence[bytes], capacity: int) -> None:
        """Marks ``chain`` most recently used on the worker; keeps at most ``capacity`` hashes."""
        tree = self._trees.setdefault(worker_id, OrderedDict())
        for h in chain:
            tree[h] = None
            tree.move_to_end(h)
        # NOTE: the chain's head was touched first, so it is evicted after its tail, as the worker's
        # own free queue does: the shared prefix outlives the request's private suffix.
        while len(tree) > max(0, capacity):
            tree.popitem(last=False)

    def forget(self, worker_ids: set[str]) -> None:
        """Drops the trees of workers not in ``worker_ids`` (gone from discovery)."""
        for w in list(self._trees):
            if w not in worker_ids:
                del self._trees[w]


class ApproxTreePolicy(RouterPolicy):
    """Router-local prefix tree (no index, no events), SGLang-style cache-aware routing."""

    name = "approx-tree"

    def __init__(self, config: PolicyConfig | None = None, tree_config: ApproxTreeConfig | None = None) -> None:
        super().__init__(config)
        self.tree_config = tree_config or ApproxTreeConfig()
        self.tree = ApproxPrefixTree()

    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        tc = self.tree_config
        with self._lock:
            decision = self._decide(query, candidates)
            chosen = next(c for c in candidates if c.worker_id == decision.worker_id)
            capacity = chosen.load.num_total_blocks or tc.default_capacity_blocks
            self.tree.insert(chosen.worker_id, query.block_hashes, capacity)
        return decision

    def _decide(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        tc = self.tree_config
        busy = [c.inflight_requests for c in candidates]
        if max(busy) - min(busy) > tc.balance_abs_requests and max(busy) > tc.balance_rel * min(busy):
            i = self._pick_min(busy)
            return Decision(candidates[i].worker_id, "balance", busy[i])
        matches = [self.tree.match(c.worker_id, query.block_hashes) for c in candidates]
        best = max(matches)
        if query.prompt_len and best * query.block_size > tc.cache_threshold * query.prompt_len:
            i = self._pick_min([-m for m in matches])
            return Decision(candidates[i].worker_id, "tree", best * query.block_size)
        sizes = [self.tree.size(c.worker_id) for c in candidates]
        i = self._pick_min(sizes)
        return Decision(candidates[i].worker_id, "capacity", sizes[i])

    def _pick_min(self, keys: Sequence[int]) -> int:
        low = min(keys)
        tied = [i for i, k in enumerate(keys) if k == low]
        # NOTE: called under self._lock, so the RNG is drawn directly (_choice_index would re-lock).
        return tied[0] if len(tied) == 1 else tied[self._rng.randrange(len(tied))]
