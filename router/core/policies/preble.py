"""``preble``: Preble's E2 global scheduler, on its own tree of the prompts it routed.

Follows WukLab/preble @8e7906a3b766 (read there; no code copied): ``preble/global_scheduler_with_time.py``
(``GlobalSchedulerWithTime``, ``SlidingWindowHistogram``), ``preble/global_lru_cache.py``
(``LPRadixCache``, ``TreeNode``), ``preble/ttft_overload_detector.py`` and ``preble/server/server.py``
(the server's settings: eviction on, rebalancing on). Paper: Srivatsa et al., "Preble: Efficient
Distributed Prompt Scheduling for LLM Serving", ICLR 2025.

State (one scheduler per router):

- a radix tree of every prompt the router routed (block hashes here, tokens in Preble). A node is
  *large* when it holds more tokens than its context before it; a request's *important node* is its
  nearest large ancestor-or-self. Per node and worker: live requests through it (``ref``, +1 when
  routed, -1 when finished), whether Preble counts it as cached there, and its *allocation* (the
  workers the scheduler assigned it to);
- a 3-minute window of the routed requests per important node: count, hit and prompt tokens, the
  last request's max_tokens.

Per request (``runtime_selector``):

1. insert the prompt; ``new`` = its tokens not in the tree, ``reused`` = those that were;
2. exploit if ``new < reused``: the candidates are the allocation of the nearest allocated ancestor;
   one candidate wins outright; else explore: every worker;
3. among the candidates, the least ``load(w) + eviction_cost(w)``;
4. the chosen worker joins the allocation of the whole path; ``ref`` +1 along it; bookkeeping
   eviction when the worker's cached tokens pass its capacity;
5. once ``50 * N`` requests were routed, rebalance: while the heaviest worker's load is at least
   1.5 x the lightest's, move its cheapest large nodes (seen twice or more in the window) to the
   lightest, or, when it has only one, replicate that one there if its TTFT doubled in the window.

``load(w)`` = sum over the window's important nodes allocated to ``w`` of
``miss_rate * count * prefill_time(node) / |allocation| + ref(node, w) * max_tokens * tpot(w)``;
``tpot(w)`` = the median of the last 200 measured TPOTs on ``w`` (0.15 s before any). The
eviction cost assumes ``w``'s memory full: evict its least-used cached nodes until the new tokens
fit and pay the windowed prefill of the large ones evicted. ``prefill_time`` comes from the
learned step cost (router/core/policies/cost.py; Preble profiles its GPU offline), a nominal profile
before the first fit.

Deviations from the source (docs/router.md, "Peers: what differs from the source"): blocks, not
tokens; the exploit branch's argmin returns the worker (Preble returns its position in the set);
the eviction heaps order by the worker's own ref count (Preble compares all workers' counts as a
list); tree depth is exact. This module imports neither grpc nor redis.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvmesh.contract.types import H100_8B_KV_BLOCKS
from kvmesh.router.core.inflight import Ticket
from kvmesh.router.core.policies.base import Candidate, Decision, PolicyConfig, RouteQuery, RouterPolicy
from kvmesh.router.core.policies.cost import StepCost, StepCostLearner

WINDOW_S = 180.0
"""The histogram's and the overload detector's window (``timedelta(minutes=3)``)."""
HIGH_LOAD_THRESHOLD = 1.5
"""Rebalance while the heaviest worker carries at least this x the lightest's load."""
REBALANCE_AFTER_PER_WORKER = 50
"""Rebalancing starts once this x N requests were routed."""
REBALANCING_CHAIN_LENGTH = 3
"""Rebalance only after requests whose leaf is less than this many nodes below its important node."""
DEFAULT_MAX_TOKENS = 45
"""The decode length of a request that sets no max_tokens (the server's default)."""
TPOT_SEED_S = 0.15
TPOT_SAMPLES = 200
NOMINAL_STEP_S = 4.2e-3
NOMINAL_PREFILL_TOKEN_S = 1.08e-4
"""Before the step cost is learned: the slope and intercept of Preble's own prefill profile
(``mistral_7b_A6000_sglang_linear``, benchmarks/exp_configs/model_equations.py)."""


class _Node:
    """A radix-tree node: a run of block hashes no prompt branches inside."""

    __slots__ = ("parent", "children", "hashes", "context", "ref", "cached", "alloc", "last_access", "serial")

    def __init__(self, parent: _Node | None, hashes: list[bytes], context: int, now: float, serial: int) -> None:
        self.parent = parent
        self.children: dict[bytes, _Node] = {}
        self.hashes = hashes
        self.context = context
        """Blocks from the root through this node."""
        self.ref: dict[str, int] = {}
        self.cached: dict[str, None] = {}
        self.alloc: dict[str, None] = {}
        """The workers this node is allocated to (Preble's ``gpu_allocations``), in the order they joined."""
        self.last_access = now
        self.serial = serial

    @property
    def blocks(self) -> int:
        return len(self.hashes)

    @property
    def large(self) -> bool:
        # NOTE: Preble's is_large_node: more tokens here than in the context before it
        return self.blocks > self.context - self.blocks


@dataclass(slots=True)
class _Stats:
    """The window's requests whose important node is ``node``."""

    node: _Node
    count: int = 0
    hit: int = 0
    prompt: int = 0
    out_len: int = DEFAULT_MAX_TOKENS

    def miss_rate(self) -> float:
        return 1.0 - self.hit / self.prompt if self.prompt else 1.0


@dataclass(slots=True)
class _Live:
    """A request routed and not finished: what its finish needs."""

    chain: Sequence[bytes]
    started: float
    first_token: float | None = None


class PreblePolicy(RouterPolicy):
    """Preble's E2 scheduling (module docstring): exploit the allocation of a reused prefix, explore
    otherwise, least windowed load plus eviction cost, rebalance hot spots. Reads no index."""

    name = "preble"
    pick_records = True
    uses_index = False

    def __init__(self, config: PolicyConfig | None = None) -> None:
        super().__init__(config)
        self._clock = self.config.clock
        self.cost = StepCostLearner()
        self._serials = itertools.count()
        self.root = _Node(None, [], 0, 0.0, next(self._serials))
        self._hist: dict[_Node, _Stats] = {}
        self._window: deque[tuple[float, _Stats, int, int]] = deque()
        """(time, stats, prompt tokens, hit tokens) of each routed request, oldest first."""
        self._cached_on: dict[str, dict[_Node, None]] = {}
        self._allocated: dict[str, int] = {}
        """Tokens Preble counts as cached on each worker."""
        self._tpots: dict[str, deque[float]] = {}
        self._tpot_median: dict[str, float] = {}
        self._ttfts: dict[tuple[_Node, str], deque[tuple[float, float]]] = {}
        self._live: dict[int, _Live] = {}
        self.routed = 0
        self._bs = 1
        self._budget = self.config.default_step_tokens
        self._m: StepCost | None = None

    # -- the pick ------------------------------------------------------------------------------------
    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        for c in candidates:
            self.cost.observe(c.worker_id, c.load)
        m = self.cost.estimate()
        now = self._clock()
        bs = self._bs = query.block_size or 1
        self._budget = max((c.load.max_num_batched_tokens for c in candidates), default=0) or \
            self.config.default_step_tokens
        ids = [c.worker_id for c in candidates]
        tail = query.prompt_len - len(query.block_hashes) * bs
        with self._lock:
            self._m = m
            if not query.block_hashes:  # NOTE: no full block: nothing to reuse or record
                w, load = self._least_cost(None, tail, ids, now)
                return Decision(w, "explore", round(load * 1000))
            leaf = self._insert(query.block_hashes, now)
            important = self._important(leaf)
            new = leaf.blocks * bs + max(0, tail)
            reused = (leaf.context - leaf.blocks) * bs
            if new < reused:
                allowed = self._inherited_allocation(leaf)
                pool = [w for w in ids if w in allowed] or ids
                reason = "exploit"
            else:
                pool, reason = ids, "explore"
            if len(pool) == 1:
                w, load = pool[0], 0.0
            else:
                w, load = self._least_cost(leaf, new, pool, now)
            self._assign(leaf, w)
            self._record(now, important, reused + new, reused, query.max_tokens or DEFAULT_MAX_TOKENS)
            self.routed += 1
            blocks = next(c.load.num_total_blocks for c in candidates if c.worker_id == w)
            # NOTE: Preble's capacity is a constant (198,516 tokens, an A6000 with Mistral-7B); here
            # the worker's reported KV capacity, else an H100's.
            self._evict(w, blocks * bs if blocks else H100_8B_KV_BLOCKS * 16)
            depth = 0
            node = leaf
            while node is not important:
                depth += 1
                node = node.parent  # type: ignore[assignment]
            if depth < REBALANCING_CHAIN_LENGTH and self.routed >= REBALANCE_AFTER_PER_WORKER * len(ids):
                self._rebalance(ids, now)
        return Decision(w, reason, round(load * 1000))

    def _least_cost(self, leaf: _Node | None, new_tokens: int, pool: Sequence[str], now: float) -> tuple[str, float]:
        """``calculate_min_load_cost``: the least windowed load plus eviction cost (first on ties).

        NOTE: Preble returns the argmin's position in ``pool``, not the worker; with a pool other
        than the first k workers that names the wrong one. This returns the worker (a deviation that
        makes the peer stronger)."""
        loads = self.loads(pool)
        best_w, best = pool[0], math.inf
        for w in pool:
            cost = loads[w] + self.eviction_cost(w, new_tokens)
            if cost < best:
                best_w, best = w, cost
        return best_w, best

    # -- the tree ----------------------------------------------------------------------------------
    def _insert(self, chain: Sequence[bytes], now: float) -> _Node:
        node, i, n = self.root, 0, len(chain)
        node.last_access = now
        while i < n:
            child = node.children.get(chain[i])
            if child is None:
                leaf = _Node(node, list(chain[i:]), node.context + n - i, now, next(self._serials))
                node.children[chain[i]] = leaf
                return leaf
            seg = child.hashes
            k = 1
            limit = min(len(seg), n - i)
            while k < limit and seg[k] == chain[i + k]:
                k += 1
            child.last_access = now
            if k < len(seg):
                child = self._split(child, k)
            node, i = child, i + k
        return node

    def _split(self, child: _Node, k: int) -> _Node:
        """``child`` becomes the lower part; the returned node holds its first ``k`` blocks."""
        parent = child.parent
        assert parent is not None
        seg = child.hashes
        upper = _Node(parent, seg[:k], child.context - len(seg) + k, child.last_access, next(self._serials))
        upper.ref = dict(child.ref)
        upper.cached = dict(child.cached)
        upper.alloc = dict(child.alloc)
        for w in upper.cached:
            self._cached_on[w][upper] = None
        parent.children[seg[0]] = upper
        upper.children[seg[k]] = child
        child.parent = upper
        child.hashes = seg[k:]
        # NOTE: handle_split_node_histogram: the window's requests of a node that is no longer
        # large now belong to its new large parent, and so does its TTFT history.
        if upper.large and not child.large and child in self._hist:
            stats = self._hist.pop(child)
            stats.node = upper
            self._hist[upper] = stats
            for w in child.alloc:
                data = self._ttfts.pop((child, w), None)
                if data is not None:
                    self._ttfts[(upper, w)] = data
        return upper

    def _find(self, chain: Sequence[bytes]) -> _Node | None:
        node, i = self.root, 0
        while i < len(chain):
            child = node.children.get(chain[i])
            if child is None or len(child.hashes) > len(chain) - i:
                return None
            node, i = child, i + len(child.hashes)
        return node

    def _important(self, node: _Node) -> _Node:
        while not node.large and node.parent is not None:
            node = node.parent
        return node

    def _inherited_allocation(self, node: _Node | None) -> dict[str, None]:
        while node is not None:
            if node.alloc:
                return node.alloc
            node = node.parent
        return {}

    def _assign(self, leaf: _Node, w: str) -> None:
        """The path joins ``w``'s allocation; one more live request through it; cached there."""
        cached_on = self._cached_on.setdefault(w, {})
        node: _Node | None = leaf
        while node is not None:
            node.alloc[w] = None
            node.ref[w] = node.ref.get(w, 0) + 1
            if w not in node.cached and node is not self.root:
                node.cached[w] = None
                cached_on[node] = None
                self._allocated[w] = self._allocated.get(w, 0) + node.blocks * self._bs
            node = node.parent

    # -- the window --------------------------------------------------------------------------------
    def _record(self, now: float, important: _Node, prompt: int, hit: int, out_len: int) -> None:
        stats = self._hist.get(important)
        if stats is None:
            stats = self._hist[important] = _Stats(important)
        stats.count += 1
        stats.hit += hit
        stats.prompt += prompt
        stats.out_len = out_len
        self._window.append((now, stats, prompt, hit))
        while self._window and self._window[0][0] < now - WINDOW_S:
            _, old, p, h = self._window.popleft()
            old.count -= 1
            old.hit -= h
            old.prompt -= p
            if old.count <= 0:
                del self._hist[old.node]
                old.node.alloc = {}  # NOTE: out of the window, the allocation is forgotten

    def _prefill_time(self, node: _Node) -> float:
        n = node.blocks * self._bs
        ctx = node.context * self._bs
        m = self._m
        steps = -(-n // self._budget)
        if m is None:
            return NOMINAL_STEP_S * steps + NOMINAL_PREFILL_TOKEN_S * n
        return m.step_s * steps + m.prefill_token_s * n + m.prefill_pair_s * n * (ctx - n + (n + 1) / 2)

    def _tpot(self, w: str) -> float:
        return self._tpot_median.get(w, TPOT_SEED_S)

    def _node_cost(self, stats: _Stats, w: str, tpot: float) -> float:
        """``get_node_cost``: the node's windowed prefill, shared by its allocation, plus its live decodes on w."""
        node = stats.node
        prefill = stats.miss_rate() * stats.count * self._prefill_time(node) / max(1, len(node.alloc))
        return prefill + node.ref.get(w, 0) * stats.out_len * tpot

    def loads(self, workers: Sequence[str], min_count: int = 0) -> dict[str, float]:
        """Each worker's windowed load in seconds (``current_allocation_per_gpu``; with ``min_count`` 2
        the rebalancer's, ``..._with_atleast_min_load``): the nodes seen fewer times are left out."""
        loads = dict.fromkeys(workers, 0.0)
        tpots = {w: self._tpot(w) for w in workers}
        for stats in self._hist.values():
            if stats.count < min_count:
                continue
            for w in stats.node.alloc:
                if w in loads:
                    loads[w] += self._node_cost(stats, w, tpots[w])
        return loads

    # -- eviction ----------------------------------------------------------------------------------
    def cached_tokens(self, w: str) -> int:
        """Tokens Preble counts as cached on ``w`` (``allocated_size``)."""
        return self._allocated.get(w, 0)

    def eviction_cost(self, w: str, tokens: int) -> float:
        """``virtual_evict_for_routing``: w's memory taken as full, its least-used cached nodes evicted
        until ``tokens`` fit; the windowed prefill of the large ones evicted."""
        nodes = self._cached_on.get(w)
        if not nodes or tokens <= 0:
            return 0.0
        heap = [(n.ref.get(w, 0), n.last_access, n.serial, n) for n in nodes]
        heapq.heapify(heap)
        unvisited: dict[_Node, int] = {}
        freed, cost = 0, 0.0
        while freed < tokens and heap:
            x = heapq.heappop(heap)[3]
            if x is self.root:
                break
            freed += x.blocks * self._bs
            if x.large:
                stats = self._hist.get(x)
                if stats is not None:
                    cost += stats.miss_rate() * stats.count * self._prefill_time(x)
                else:
                    cost += x.ref.get(w, 0) * self._prefill_time(x)
            p = x.parent
            assert p is not None
            left = unvisited.get(p)
            if left is None:
                left = sum(1 for c in p.children.values() if w in c.cached)
            left -= 1
            unvisited[p] = left
            if left <= 0:
                heapq.heappush(heap, (p.ref.get(w, 0), p.last_access, p.serial, p))
        return cost

    def _evict(self, w: str, capacity_tokens: int) -> None:
        """``handle_eviction``: past ``capacity_tokens``, w's unused cached nodes stop counting as cached,
        least recently used first (leaves before their parents)."""
        excess = self._allocated.get(w, 0) - capacity_tokens
        if excess <= 0:
            return
        cached_on = self._cached_on[w]
        heap = [(n.last_access, n.serial, n) for n in cached_on if not n.ref.get(w, 0)]
        heapq.heapify(heap)
        evicted = 0
        while evicted < excess and heap:
            x = heapq.heappop(heap)[2]
            if x is self.root:
                break
            if x.ref.get(w, 0) or w not in x.cached:
                continue
            del x.cached[w]
            del cached_on[x]
            size = x.blocks * self._bs
            self._allocated[w] -= size
            evicted += size
            p = x.parent
            assert p is not None
            if not any(w in c.cached for c in p.children.values()):
                heapq.heappush(heap, (p.last_access, p.serial, p))

    # -- rebalancing -------------------------------------------------------------------------------
    def _rebalance(self, workers: Sequence[str], now: float) -> None:
        """``handle_important_node_stealing``: heaviest against lightest, then the next heaviest."""
        loads = self.loads(workers, min_count=2)
        order = sorted(workers, key=lambda w: -loads[w])  # NOTE: stable: ties in candidate order
        costs = [loads[w] for w in order]
        while len(order) > 1:
            heavy, light = order[0], order[-1]
            c_heavy, c_light = costs[0], costs[-1]
            if c_heavy < HIGH_LOAD_THRESHOLD * c_light:
                return
            tpot = self._tpot(heavy)
            nodes = [(self._node_cost(s, heavy, tpot), s.node.serial, s) for s in self._hist.values()
                     if heavy in s.node.alloc and s.node.large and s.count > 1]
            if len(nodes) == 1:
                cost, _, stats = nodes[0]
                cost /= 2
                node = stats.node
                if light not in node.alloc and self._overloaded(node, heavy, now):
                    c_heavy -= cost
                    c_light += cost
                    node.alloc[light] = None
                    self._ttfts.pop((node, heavy), None)
            else:
                heapq.heapify(nodes)
                while nodes:
                    cost, _, stats = heapq.heappop(nodes)
                    if c_heavy - cost < c_light + cost:
                        break
                    c_heavy -= cost
                    c_light += cost
                    self._move(stats.node, light)
                    if c_heavy < HIGH_LOAD_THRESHOLD * c_light:
                        break
            costs[0], costs[-1] = c_heavy, c_light
            order, costs = order[1:], costs[1:]

    def _move(self, node: _Node, w: str) -> None:
        """The node and everything below it are allocated to ``w`` alone."""
        todo = [node]
        while todo:
            n = todo.pop()
            n.alloc = {w: None}
            todo.extend(n.children.values())

    def _overloaded(self, node: _Node, w: str, now: float) -> bool:
        """``TTFTWindowedOverloadedDetector``: the node's TTFTs on w in the window's second half average at
        least twice those of its first half (both halves non-empty)."""
        data = self._ttfts.get((node, w))
        if not data:
            return False
        cut = now - WINDOW_S / 2
        first = [v for t, v in data if t < cut]
        second = [v for t, v in data if t >= cut]
        if not first or not second:
            return False
        return sum(second) / len(second) >= 2 * sum(first) / len(first)

    # -- the requests' lifecycle -------------------------------------------------------------------
    def started(self, ticket: Ticket, query: RouteQuery, chosen: Candidate) -> None:
        if query.block_hashes:
            with self._lock:
                self._live[ticket.serial] = _Live(query.block_hashes, self._clock())

    def prefilled(self, ticket: Ticket) -> None:
        with self._lock:
            live = self._live.get(ticket.serial)
            if live is not None:
                live.first_token = self._clock()

    def finished(self, ticket: Ticket, output_tokens: int) -> None:
        """``finish_request``: the TTFT into the overload detector, the TPOT into the worker's median,
        one live request less along the prompt's path."""
        with self._lock:
            live = self._live.pop(ticket.serial, None)
            if live is None:
                return
            now, w = self._clock(), ticket.worker_id
            node = self._find(live.chain)
            if node is None:
                return
            if live.first_token is not None:
                data = self._ttfts.setdefault((self._important(node), w), deque())
                data.append((now, live.first_token - live.started))
                while data and data[0][0] < now - WINDOW_S:
                    data.popleft()
                if output_tokens > 1 and now > live.first_token:
                    tpots = self._tpots.get(w)
                    if tpots is None:
                        tpots = self._tpots[w] = deque([TPOT_SEED_S], maxlen=TPOT_SAMPLES)
                    tpots.append((now - live.first_token) / (output_tokens - 1))
                    ordered = sorted(tpots)
                    mid = len(ordered) // 2
                    self._tpot_median[w] = ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
            while node is not self.root and node is not None:
                n = node.ref.get(w, 0)
                if n > 1:
                    node.ref[w] = n - 1
                else:
                    node.ref.pop(w, None)
                node = node.parent
