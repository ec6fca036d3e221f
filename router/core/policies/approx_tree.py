"""``approx-tree``: SGLang's cache-aware router, a router-local guess of every worker's prefix cache
(no index, no events).

Follows sgl-project/sglang (read at these commits; no code copied): ``sgl-router/src/policies/cache_aware.rs``
@026f853ba7ae (``select_worker``), ``sgl-router/src/policies/tree.rs`` @4d40eec0266b (``prefix_match``,
``get_smallest_tenant``, ``evict_tenant_by_size``) and the launcher's defaults,
``sgl-router/py_src/sglang_router/router_args.py`` @083d601378d0 (``RouterArgs``: what
``python -m sglang_router.launch_router`` runs; the library's ``CacheAwareConfig::default`` differs).

Like SGLang's router, it remembers which prompts it sent where and assumes the worker still holds
them; it never hears about evictions. Block hashes are chained, so a set of hashes per worker *is* a
prefix tree: a prompt's match on a worker is the number of its leading hashes in that worker's set.

Per request (``pick``):
1. If the router's own in-flight counts are imbalanced (max - min > ``balance_abs_requests`` and
   max > ``balance_rel`` x min), the first least busy worker wins ("balance").
2. Else the worker with the longest match wins when it covers more than ``cache_threshold`` of the
   prompt ("tree"); otherwise the worker with the smallest tree ("capacity").
3. The prompt's blocks are inserted into the winner's tree, whatever the branch.

Every ``eviction_interval_s`` the trees larger than ``max_tree_blocks`` drop their least recently used
blocks, leaves first; between two sweeps they grow without bound (SGLang's background eviction thread,
run here at the first pick after each period). SGLang counts the tree in characters (2^26 per
worker); here in blocks, at 4 characters per token.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.router.core.policies.base import Candidate, Decision, PolicyConfig, RouteQuery, RouterPolicy

CHARS_PER_TOKEN = 4
"""To turn SGLang's tree bound in characters into blocks."""


@dataclass(slots=True)
class ApproxTreeConfig:
    """SGLang's launcher defaults (``RouterArgs``)."""

    cache_threshold: float = 0.3
    """Share of the prompt a worker's tree must match (strictly more) to win on cache."""
    balance_abs_requests: int = 64
    """Imbalance: the busiest worker has more than this many in-flight requests over the least busy ..."""
    balance_rel: float = 1.5
    """... and more than this times as many."""
    eviction_interval_s: float = 120.0
    """Seconds between two sweeps of the trees."""
    max_tree_chars: int = 2 ** 26
    """A worker's tree is cut to this many characters at each sweep."""

    def max_tree_blocks(self, block_size: int) -> int:
        return max(1, self.max_tree_chars // (CHARS_PER_TOKEN * max(1, block_size)))


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

    def insert(self, worker_id: str, chain: Sequence[bytes]) -> None:
        """Marks ``chain`` most recently used on the worker."""
        tree = self._trees.setdefault(worker_id, OrderedDict())
        # NOTE: tail first, head last: the shared head is the most recent, so an eviction drops the
        # request's private tail before the prefix it shares (SGLang evicts leaves first).
        for h in reversed(chain):
            tree[h] = None
            tree.move_to_end(h)

    def evict(self, max_blocks: int) -> None:
        """Every tree larger than ``max_blocks`` drops its least recently used blocks down to it."""
        for tree in self._trees.values():
            while len(tree) > max_blocks:
                tree.popitem(last=False)

    def forget(self, worker_ids: set[str]) -> None:
        """Drops the trees of workers not in ``worker_ids`` (gone from discovery)."""
        for w in list(self._trees):
            if w not in worker_ids:
                del self._trees[w]


class ApproxTreePolicy(RouterPolicy):
    """SGLang's cache-aware routing on a router-local prefix tree (module docstring)."""

    name = "approx-tree"
    pick_records = True

    def __init__(self, config: PolicyConfig | None = None, tree_config: ApproxTreeConfig | None = None) -> None:
        super().__init__(config)
        self.tree_config = tree_config or ApproxTreeConfig()
        self.tree = ApproxPrefixTree()
        self._next_sweep: float | None = None

    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        tc = self.tree_config
        now = self.config.clock()
        with self._lock:
            if self._next_sweep is None:
                self._next_sweep = now + tc.eviction_interval_s
            elif now >= self._next_sweep:
                self.tree.evict(tc.max_tree_blocks(query.block_size))
                self._next_sweep = now + tc.eviction_interval_s
            decision = self._decide(query, candidates)
            self.tree.insert(decision.worker_id, query.block_hashes)
        return decision

    def _decide(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        tc = self.tree_config
        busy = [c.inflight_requests for c in candidates]
        low, high = min(busy), max(busy)
        if high - low > tc.balance_abs_requests and high > tc.balance_rel * low:
            i = busy.index(low)  # NOTE: SGLang takes the first worker with the least load
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
