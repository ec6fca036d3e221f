"""The information limit: kv-aware given what no router can have (a simulator-only reference).

:class:`InformationLimit` scores workers with kv-aware's rule (router/core/policies/kv_aware.py: predicted
time to first token, plus its prefill's cost to the requests decoding there and to the backlogged
mesh), but every input is exact, read from the simulated engines at the instant of the pick:

- each worker's prefix hit for the prompt, from its block pool (not the index, not a guess);
- its queue: the running requests (what each has left to prefill, the decodes and their contexts),
  the waiting ones with their own exact hits, and the requests routers sent it that have not
  arrived;
- what is left of the step it is running;
- its own step-time function (the worker's roofline, not a fit of reports): the queue ahead and
  the request's own prefill are walked step by step, chunked at the worker's token budget.

The run has no delays (Lookup, network, event messages: 0). It lives in kvmesh/sim/ and is
installed only by the simulator (``kvmesh.sim.run.Sim`` for the name :data:`INFORMATION_LIMIT`) into
routers it builds: the policy registry (router/core/policies/__init__.py) does not know it, and
router/ cannot import kvmesh/sim/ (import-linter's layers).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvmesh.router.core.policies.base import Candidate, Decision, PolicyConfig, RouteQuery
from kvmesh.router.core.policies.kv_aware import KvAwarePolicy, copy_in_free_kv, surplus_in_full_kv

if TYPE_CHECKING:
    from kvmesh.sim.mesh import Mesh
    from kvmesh.sim.worker import Attempt, SimWorker

INFORMATION_LIMIT = "information-limit"
"""The reference's name in `kvmesh simulate` results (``limits.information`` in the JSON)."""

ZERO_DELAYS = {"lookup_latency_s": 0.0, "network_s": 0.0, "event_delay_s": 0.0}
"""SimConfig changes of an information-limit run."""


class ExactView:
    """The mesh's engines as they are now, and the requests on their way to them (shared by every
    router of the run)."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh = mesh
        self.transit: dict[str, deque[tuple[Sequence[bytes], int]]] = {w.worker_id: deque() for w in mesh.workers}
        for w in mesh.workers:
            w.submit = self._arriving(w, w.submit)  # type: ignore[method-assign]

    def _arriving(self, worker: SimWorker, submit):
        chains = self.mesh.chains

        def arrive(a: Attempt) -> None:
            pending = self.transit[worker.worker_id]
            chain = chains[a.record.index]
            for i, (c, _) in enumerate(pending):
                if c is chain:
                    del pending[i]
                    break
            submit(a)

        return arrive

    def sent(self, worker_id: str, query: RouteQuery) -> None:
        self.transit[worker_id].append((query.block_hashes, query.prompt_len))

    def state(self, worker_id: str, query: RouteQuery, adjust_blocks: float = 0.0) -> tuple[float, float, int, int]:
        """(seconds until the request's first token there, seconds of its own prefill there as kv-aware
        counts it, requests decoding there, requests waiting there), all exact. ``adjust_blocks``: blocks
        past its exact hit to count as held (< 0: of its hit to count as not), as kv-aware's work
        term counts a prefix's copies (router/core/policies/prefix_load.py)."""
        w = self.mesh.workers_by_id[worker_id]
        engine, runner = w.engine, w.runner
        if not w.up or engine is None or runner is None:
            return math.inf, math.inf, 0, 0
        pool = engine.kv_cache_manager.block_pool.cached_block_hash_to_block
        host = engine.kv_cache_manager.host_pool
        bs = engine.config.block_size
        loads = [0]  # NOTE: host-tier tokens the requests ahead and ours load back (their steps wait)

        def hit(chain: Sequence[bytes], prompt_len: int) -> int:
            n, limit = 0, (prompt_len - 1) // bs
            for h in chain[:limit]:
                if not pool.get(h):
                    break
                n += 1
            if host is not None:
                m = len(host.find_run(chain, n, limit))
                loads[0] += m * bs
                n += m
            return n * bs

        items: list[list[int]] = []  # [start, tokens left] of every prefill ahead, FCFS, ours last
        decoders, context = 0, 0
        for r in engine.scheduler.running:
            if r.num_output_tokens == 0 or r.num_computed_tokens < r.num_tokens - 1:
                items.append([r.num_computed_tokens, r.num_tokens - r.num_computed_tokens])
            else:
                decoders += 1
                context += r.num_tokens
        queued = list(engine.scheduler.waiting) + engine.queued_requests()
        for r in queued:
            h = hit(r.block_hashes, r.num_tokens) if r.num_computed_tokens == 0 else r.num_computed_tokens
            items.append([h, r.num_tokens - h])
        for chain, prompt_len in self.transit[worker_id]:
            h = hit(chain, prompt_len)
            items.append([h, prompt_len - h])
        ahead = loads[0]
        h = max(hit(query.block_hashes, query.prompt_len), self._ahead(worker_id, query) * bs)
        if adjust_blocks:
            h = min(query.prompt_len - 1, max(0, round(h + adjust_blocks * bs)))
        items.append([h, query.prompt_len - h])
        ttft, own = self._walk(runner.cost, items, decoders, context, engine.config.max_num_batched_tokens)
        if loads[0]:
            own += runner.cost.host_copy_s(loads[0] - ahead)
            ttft += runner.cost.host_copy_s(loads[0])
        if w.stepping:
            ttft += max(0.0, w.busy_until - self.mesh.q.now)
        return ttft, own, decoders, len(queued) + len(self.transit[worker_id])

    def held_blocks(self, worker_id: str, query: RouteQuery) -> int:
        """Leading blocks of the prompt the worker holds now or computes before it (exact): its device
        pool's, or a request ahead of it there (FCFS) that shares them."""
        w = self.mesh.workers_by_id[worker_id]
        if not w.up or w.engine is None:
            return 0
        pool = w.engine.kv_cache_manager.block_pool.cached_block_hash_to_block
        n = 0
        for h in query.block_hashes:
            if not pool.get(h):
                break
            n += 1
        return max(n, self._ahead(worker_id, query))

    def _ahead(self, worker_id: str, query: RouteQuery) -> int:
        """Leading blocks of the prompt a request ahead of it at the worker (running, waiting, on its way)
        shares: computed before it is, so a hit an exact view knows of (the index learns it later)."""
        w = self.mesh.workers_by_id[worker_id]
        engine = w.engine
        chain = query.block_hashes
        if engine is None or not chain:
            return 0
        limit = (query.prompt_len - 1) // query.block_size
        first = chain[0]
        best = 0
        chains = [r.block_hashes for r in engine.scheduler.running]
        chains += [r.block_hashes for r in list(engine.scheduler.waiting) + engine.queued_requests()]
        chains += [c for c, _ in self.transit[worker_id]]
        for other in chains:
            if not other or other[0] != first:
                continue
            n = 1
            while n < min(len(other), limit) and other[n] == chain[n]:
                n += 1
            best = max(best, min(n, limit))
        return best

    @staticmethod
    def _walk(cost, items: list[list[int]], decoders: int, context: int, budget: int) -> tuple[float, float]:
        """The steps until the last item's last token, chunked at ``budget`` tokens less the decodes:
        (their seconds, the seconds of the last item's chunks each alone with the decodes: kv-aware's
        ``own``, its prefill plus the steps it takes, on the exact step time)."""
        per_step = max(1, budget - decoders)
        last = len(items) - 1
        t = own = 0.0
        i, k = 0, 0
        while i <= last:
            take, tokens, pairs, mine, mine_pairs = per_step, 0, 0.0, 0, 0.0
            while take and i <= last:
                start, left = items[i]
                n = min(take, left)
                p = n * (start + (n + 1) / 2)
                tokens += n
                pairs += p
                if i == last:
                    mine, mine_pairs = n, p
                items[i][0] += n
                items[i][1] -= n
                take -= n
                if items[i][1] == 0:
                    i += 1
            ctx = context + k * decoders
            step = cost.time(tokens, pairs, decoders, ctx)
            t += step
            if mine:
                own += cost.time(mine, mine_pairs, decoders, ctx)
            k += 1
        return t, own


class InformationLimit(KvAwarePolicy):
    """kv-aware's score on exact state (module doc); simulator only."""

    name = INFORMATION_LIMIT

    def __init__(self, config: PolicyConfig, view: ExactView) -> None:
        super().__init__(config)
        self.view = view

    def pick(self, query: RouteQuery, candidates: Sequence[Candidate]) -> Decision:
        states = [self.view.state(c.worker_id, query) for c in candidates]
        lam = self.config.decode_harm_weight
        kappa = self.config.work_weight * (1.0 + sum(s[3] for s in states) / len(states))
        # NOTE: kv-aware's prefixes over time (router/core/policies/prefix_load.py) on the exact hits: a
        # copy a hot prefix needs counts as load where the KV is free, a surplus copy on full KV as a
        # recompute; the placement of a prompt nobody holds is kv-aware's own.
        with self._lock:
            share = self.prefixes.replicas(query.block_hashes, [c.worker_id for c in candidates],
                                           [self.view.held_blocks(c.worker_id, query) for c in candidates])
        scores = []
        for c, (ttft, own, decoders, _), replica in zip(candidates, states, share, strict=True):
            adjust = copy_in_free_kv(query, c, replica) if replica > 0 else surplus_in_full_kv(query, c, replica)
            work = self.view.state(c.worker_id, query, adjust)[1] if adjust else own
            scores.append(ttft + lam * decoders * own + kappa * work)
        i = self._argmin_index(scores)
        placed = self._placement(query, candidates, scores)
        chosen = candidates[i if placed is None else placed]
        self.view.sent(chosen.worker_id, query)
        return Decision(chosen.worker_id, "exact", round(min(scores) * 1000) if math.isfinite(min(scores)) else 0)


def install(mesh: Mesh) -> None:
    """Every router of ``mesh`` picks with :class:`InformationLimit` over one :class:`ExactView`."""
    view = ExactView(mesh)
    for router in mesh.routers:
        router.core.policy = InformationLimit(router.core.policy.config, view)
