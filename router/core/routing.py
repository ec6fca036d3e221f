"""The router's decisions, pure: prompt -> chain -> one index lookup -> candidates -> pick -> in-flight.

The live router (router/model_router.py: tokenizing, forwarding, retries, streaming) and the virtual-time
simulator (kvmesh/sim/) both call :class:`RoutingCore`, so what the simulator measures is the code
that routes in production. Everything here is decision logic:

- hashing the prompt into its block chain (one :class:`BlockHasher` per model spec);
- whether to ask the index at all: the policy must use it, the prompt must have a full block and
  the breaker must be closed (after a failed Lookup the index is skipped for ``index_retry_s``);
- merging the Lookup answer (matched blocks, and each worker's load, fresher than discovery's)
  with the speculative map (router/core/speculative.py) and this router's in-flight view
  (router/core/inflight.py) into :class:`Candidate`s;
- the policy's pick (router/core/policies/: hot-spot guard, rendezvous fallback) and the speculative
  record of it; the in-flight accounting of the request on the chosen worker;
- the shared router view (docs/router.md, "Several routers"): for a policy that reads it, each
  pick becomes a :class:`Reservation` the caller makes in the kv_service before forwarding; a
  refused one (another router reserved the worker since this router's Lookup) updates the
  candidates' pending picks and the policy picks again, ``reservation_attempts`` times at most, the last
  one unconditional. A pick made without the Lookup because it came back late (the index answered
  other calls meanwhile: slow, not down) is reserved unconditionally. router/core/reservation_loop.py's
  :class:`ReservationLoop` is that loop without its I/O: the live router awaits each Reserve
  (router/model_router.py), the simulator schedules it on its clock (kvmesh/sim/router.py).

No grpc, no redis, no threads, no wall clock: time is the injected ``clock`` (monotonic seconds),
and the index is anything with a ``lookup`` (router/core/upstream.py's ``PrefixIndex``). Metrics go to
an injected :class:`DecisionObserver`; the live router maps them to Prometheus.

A plan is :meth:`RoutingCore.prepare` (the chain and whether to ask the index), the Lookup (awaited
live, router/model_router.py; answered at once in the simulator, :meth:`RoutingCore.plan`), then
:meth:`RoutingCore.complete` (the outcome taken in, the candidates built): one code for both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace

from kvmesh.contract.block_hash import BlockHasher, adapter_hasher
from kvmesh.contract.errors import InvalidArgument
from kvmesh.contract.index_protocol import (
    IndexUnavailable,
    Pending,
    Reservation,
    ReservationAnswer,
    WorkerMatch,
    anchor_positions,
    anchors_of,
)
from kvmesh.contract.limits import MAX_CHAIN_BLOCKS
from kvmesh.contract.types import ModelSpec
from kvmesh.router.core.breaker import IndexBreaker
from kvmesh.router.core.chain_cache import ChainCache
from kvmesh.router.core.inflight import InFlight, Ticket
from kvmesh.router.core.observer import CountingObserver, DecisionObserver
from kvmesh.router.core.plan import PendingPlan, RoutePlan
from kvmesh.router.core.policies.base import (
    NO_OBJECTIVES,
    Candidate,
    Decision,
    Objectives,
    RouteQuery,
    RouterPolicy,
    uncached_tokens,
)
from kvmesh.router.core.speculative import SpeculativeIndex
from kvmesh.router.core.upstream import WorkerEndpoint

log = logging.getLogger("kvmesh.router")


class RoutingCore:
    """One router's decision state: policy, speculative map, in-flight view, index breaker.

    Args:
        policy: the routing policy (router/core/policies/).
        speculative_ttl_s: how long a pick counts as the worker holding the prompt's blocks (0 = off).
        index_retry_s: after a failed Lookup, skip the index this long.
        clock: monotonic seconds (time.monotonic live, the virtual clock in the simulator).
        observer: receives decision / fallback / lookup-latency counts; None = not counted.
        shared_view: reserve picks in the kv_service and read the other routers' (when the policy
            reads the view).
        router_id: this router's id in its reservations.
        reservation_attempts: reservations per request at most; the last is unconditional.
    """

    def __init__(self, policy: RouterPolicy, *, speculative_ttl_s: float = 2.0, index_retry_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, observer: DecisionObserver | None = None,
                 shared_view: bool = False, router_id: str = "router", reservation_attempts: int = 10,
                 fold_reserve: bool = False) -> None:
        self.policy = policy
        self.shared_view = shared_view and policy.shares_view
        self.fold_reserve = fold_reserve
        self._seen: dict[str, WorkerMatch] = {}
        """The last Lookup answer, by worker: the loads, pending picks and versions the folded reservation's
        pick is made on (:meth:`tentative`)."""
        self._since_seen: dict[str, Pending] = {}
        """This router's picks reserved since that answer, by worker (finished or not: the workers' reports
        lag them, and the next answer will count them)."""
        self.router_id = router_id
        self.reservation_attempts = reservation_attempts
        self.clock = clock
        self.speculative = SpeculativeIndex(speculative_ttl_s, clock=clock)
        self.inflight = InFlight()
        self.breaker = IndexBreaker(index_retry_s, clock)
        self.observer: DecisionObserver = observer or CountingObserver()
        self._hashers: dict[tuple[ModelSpec, str], BlockHasher] = {}
        self.chains = ChainCache()
        """The chains of recent long prompts (a shared prefix is hashed once)."""

    # -- 1. the chain ---------------------------------------------------------------------------
    def hasher(self, spec: ModelSpec, adapter: str = "") -> BlockHasher:
        """The model's hasher; under a LoRA adapter, its name an extra key of every block (the engine's own
        keying, kvmesh/contract/block_hash.py ``adapter_hasher``)."""
        key = (spec, adapter)
        h = self._hashers.get(key)
        if h is None:
            if len(self._hashers) >= 4096:  # adapters come and go: bound the memo
                self._hashers.clear()
            base = BlockHasher(spec.model_id, spec.block_size, spec.hash_algorithm)
            h = self._hashers[key] = adapter_hasher(base, adapter)
        return h

    def chain(self, spec: ModelSpec, token_ids: Sequence[int], cache_salt: str = "", adapter: str = "") -> list[bytes]:
        """The prompt's block hashes (under ``adapter``, "" = the base model). Raises InvalidArgument on token
        ids that cannot be hashed."""
        try:
            return self.chains.chain(self.hasher(spec, adapter), token_ids, cache_salt)
        except ValueError as exc:
            raise InvalidArgument(f"token_ids: {exc}") from None

    # -- 2. the index ---------------------------------------------------------------------------
    def wants_index(self, chain: Sequence[bytes]) -> bool:
        """Whether this request's pick would use a Lookup (the policy reads it, the prompt has a block)."""
        return self.policy.uses_index and bool(chain)

    def index_allowed(self, have_index: bool = True) -> bool:
        """Whether to ask the index now; counts the fallback cause when not."""
        if not have_index:
            self.observer.fallback("no_index")
            return False
        if self.breaker.open():
            self.observer.fallback("index_down")
            return False
        return True

    def lookup_succeeded(self, seconds: float) -> None:
        self.breaker.answered()
        self.observer.lookup_latency(seconds)

    def lookup_failed(self, exc: IndexUnavailable, asked_at: float | None = None) -> bool:
        """A Lookup (asked at ``asked_at``) did not answer; True when it was only late: the index
        answered another call meanwhile (counted ``lookup_late``; the breaker stays closed). Only
        ``lookup_failed`` (down, too slow) can open the breaker: a Lookup the index refused as
        malformed (``lookup_invalid``) is that request's problem, and every other client keeps the index."""
        if exc.cause == "lookup_failed":
            if not self.breaker.failed(asked_at):
                self.observer.fallback("lookup_late")
                log.debug("kv_service lookup late (it answers other calls), routing this request without it: %s",
                          exc)
                return True
            log.warning("kv_service lookup failed, routing by rendezvous hash: %s", exc)
        elif exc.cause == "lookup_invalid":
            log.warning("kv_service refused a Lookup, routing this request without it: %s", exc)
        self.observer.fallback(exc.cause)
        return False

    # -- 3. the candidates ----------------------------------------------------------------------
    def build(self, spec: ModelSpec, token_ids: Sequence[int], chain: list[bytes],
              endpoints: Iterable[WorkerEndpoint], answer: Sequence[WorkerMatch] | None, index_ok: bool, *,
              adopt: bool, healthy: Callable[[str], bool] = lambda _w: True, max_tokens: int = 0,
              asked_at: float | None = None, reserve_blind: bool = False,
              objectives: Objectives = NO_OBJECTIVES, adapter: str = "") -> RoutePlan:
        """The candidates of one request.

        Args:
            answer: the Lookup's answer, or None when the index was not asked or failed.
            index_ok: False when the index was wanted but could not be asked.
            adopt: a worker the Lookup names that discovery has not listed yet joins the candidates
                (discovery from the index); False with a static worker list.
            healthy: whether a worker is free of a recent failure mark.
            max_tokens: the request's max_tokens, for policies that cost its decode.
            objectives: the request's latency objectives, for policies that use them.
            adapter: the LoRA adapter the request runs under: only the workers that serve it are candidates.
            asked_at: when the Lookup was asked (the shared view adds this router's picks reserved since).
            reserve_blind: the Lookup was late but the index answers: the pick made without it is still
                reserved (unconditionally), so the other routers see it.
        """
        eps = {e.worker_id: e for e in endpoints}
        matched: dict[str, int] = {}
        indexed: dict[str, int] = {}
        reach: dict[str, int] = {}
        """The index's device prefix plus its host continuation, per worker (host tiers only)."""
        shared = self.shared_view and answer is not None
        pending: dict[str, WorkerMatch] = {}
        if answer is not None:
            for m in answer:
                known = eps.get(m.worker_id)
                if known is not None:
                    # NOTE: the Lookup's load is fresher than the last discovery poll.
                    eps[m.worker_id] = replace(known, load=m.load)
                elif adopt:  # registered since the last poll
                    eps[m.worker_id] = WorkerEndpoint(m.worker_id, m.address, m.load)
                else:  # static --workers: a worker outside the list is not ours to use
                    continue
                matched[m.worker_id] = indexed[m.worker_id] = m.matched_blocks
                if m.host_blocks:
                    reach[m.worker_id] = m.matched_blocks + m.host_blocks
                if shared:
                    pending[m.worker_id] = m
                    # NOTE: the prefix another router's reserved pick will hold there: its speculative
                    # map, shared (kv_service/pending_prefixes.py); without it three routers piled a
                    # burst onto the prefix's holder where one router spread it (issue 35).
                    if m.pending_blocks > m.matched_blocks:
                        matched[m.worker_id] = m.pending_blocks
        if self.wants_index(chain):
            for worker_id, n in self.speculative.matches(chain).items():
                if worker_id in eps and n > matched.get(worker_id, 0):
                    matched[worker_id] = n
        candidates = []
        for e in eps.values():
            f = self.inflight.of(e.worker_id)
            n = matched.get(e.worker_id, 0)
            c = Candidate(e.worker_id, e.address, n, e.load, f.requests,
                          f.prefill_tokens, f.waiting, f.blocks, indexed.get(e.worker_id, 0))
            r = reach.get(e.worker_id)
            if r is not None:
                # NOTE: the host tier continues the index's device prefix; a longer speculative match
                # (blocks routed there since) covers the first of those blocks.
                c.host_blocks = max(0, r - n)
                c.indexed_host_blocks = r - c.indexed_blocks
            m = pending.get(e.worker_id)
            if m is not None:
                c.pending = self._with_own(m.pending, e.worker_id, self.clock() if asked_at is None else asked_at)
            candidates.append(c)
        if adapter:
            candidates = [c for c in candidates if c.load.adapter(adapter) is not None]
        usable = [c for c in candidates if healthy(c.worker_id)]
        # NOTE: unhealthy marks are hints: when every worker carries one, try them all anyway.
        versions = ({w: m.pending.version for w, m in pending.items()} if shared
                    else {} if self.shared_view and reserve_blind and self.wants_index(chain) else None)
        return RoutePlan(token_ids, RouteQuery(len(token_ids), spec.block_size, chain, index_ok, max_tokens,
                                                    objectives, adapter),
                         usable or candidates, eps, spec.model_id, versions, conditional=shared,
                         answered=answer is not None)

    def prepare(self, spec: ModelSpec, token_ids: Sequence[int], have_index: bool, *, cache_salt: str = "",
              chain: list[bytes] | None = None, max_tokens: int = 0,
              objectives: Objectives = NO_OBJECTIVES, adapter: str = "") -> PendingPlan:
        """Steps 1-2 of a plan: the chain, and whether (and for which blocks) to ask the index.

        The caller asks the index for ``pending.lookup`` when it is not None (a Lookup awaited live,
        answered at once in the simulator) and hands the outcome to :meth:`complete`. ``chain`` may be
        passed when the caller already has the prompt's hashes (the simulator hashes each prompt
        once per trace).
        """
        if chain is None:
            chain = self.chain(spec, token_ids, cache_salt, adapter)
        lookup = None
        index_ok = True
        if self.wants_index(chain):
            index_ok = self.index_allowed(have_index)
            if index_ok:
                # NOTE: the index answers at most MAX_CHAIN_BLOCKS blocks; a longer prompt
                # (--max-prompt-tokens 0) is looked up by its leading ones, never refused.
                lookup = chain[:MAX_CHAIN_BLOCKS]
        return PendingPlan(spec, token_ids, chain, lookup, index_ok, max_tokens, self.clock(), objectives, adapter)

    def complete(self, pending: PendingPlan, endpoints: Iterable[WorkerEndpoint],
               outcome: Sequence[WorkerMatch] | IndexUnavailable | None, seconds: float = 0.0, *,
               adopt: bool, healthy: Callable[[str], bool] = lambda _w: True,
               folded: Reservation | None = None, folded_reserved: bool = False) -> RoutePlan:
        """Steps 3 of a plan: the Lookup's ``outcome`` (its answer, or the IndexUnavailable it raised;
        None when none was asked) taken in, the candidates built; ``folded``: the reservation the Lookup
        carried (:meth:`tentative`), ``folded_reserved`` whether the answer says it was made."""
        answer: Sequence[WorkerMatch] | None = None
        index_ok = pending.index_ok
        late = False
        if pending.lookup is not None:
            if isinstance(outcome, IndexUnavailable):
                late = self.lookup_failed(outcome, pending.asked_at)
                index_ok = False
                folded_reserved = False
            else:
                self.lookup_succeeded(seconds)
                answer = outcome
                self._seen = {m.worker_id: m for m in answer}
                self._since_seen = {}
        plan = self.build(pending.spec, pending.token_ids, pending.chain, endpoints, answer, index_ok, adopt=adopt,
                          healthy=healthy, max_tokens=pending.max_tokens, asked_at=pending.asked_at,
                          reserve_blind=late, objectives=pending.objectives, adapter=pending.adapter)
        if folded is not None:
            # NOTE: reserved, or perhaps reserved (the Lookup failed after it may have landed): a reservation
            # elsewhere drops it; a pick of the same worker keeps it (reserve.lua: one pick per request id).
            plan.folded, plan.folded_reserved = folded, folded_reserved
            if folded_reserved or answer is None:
                plan.release = folded.worker_id
        return plan

    def tentative(self, pending: PendingPlan, endpoints: Iterable[WorkerEndpoint], request_id: str, *,
                  healthy: Callable[[str], bool] = lambda _w: True) -> Reservation | None:
        """The pick this router would make before the Lookup answers, as the reservation the Lookup
        carries (issue 45: the Reserve folded into the Lookup): the policy on its own view, that is the
        speculative map, the in-flight view and the last answer's loads and pending picks (no matches:
        they are the Lookup's), its random state left as it was (``RouterPolicy.fallbacks``). None when
        the plan asks no index, the shared view is off, or no answer was seen yet. When the answer
        confirms the pick (``pick`` prefers it among equals), the reservation loop has nothing to send."""
        if not (self.fold_reserve and self.shared_view and pending.lookup is not None and self._seen):
            return None
        eps = list(endpoints)
        known = {e.worker_id for e in eps}
        own = self._since_seen
        view = [m._replace(matched_blocks=0, host_blocks=0, pending_blocks=0,
                           pending=_plus(m.pending, own[w]) if w in own else m.pending)
                for w, m in self._seen.items() if w in known]
        if not view:
            return None
        plan = self.build(pending.spec, pending.token_ids, pending.chain, eps, view, True, adopt=False,
                          healthy=healthy, max_tokens=pending.max_tokens, asked_at=pending.asked_at,
                          objectives=pending.objectives, adapter=pending.adapter)
        if not plan.candidates or plan.versions is None:
            return None
        worker = self.policy.fallbacks(plan.query, plan.candidates, 1)[0]
        q, c = plan.query, plan.candidate(worker)
        blocks = -(-q.prompt_len // q.block_size) if q.block_size else 0
        return Reservation(plan.model_id, worker, self.router_id, request_id, uncached_tokens(c, q), blocks,
                           plan.versions.get(worker, 0), anchors_of(q.block_hashes[:MAX_CHAIN_BLOCKS]))

    # -- 4. the pick ----------------------------------------------------------------------------
    def pick(self, plan: RoutePlan, candidates: Sequence[Candidate] | None = None, *, count: bool = True) -> Decision:
        """The policy's pick among ``candidates`` (default: all of the plan's), recorded in the
        speculative map at once (a burst's next same-prefix request follows it) and counted
        (``count=False``: the caller counts it with :meth:`commit` once its reservation is settled)."""
        prefer = plan.folded.worker_id if plan.folded is not None and plan.folded_reserved else None
        decision = self.policy.pick_preferring(plan.query, plan.candidates if candidates is None else candidates,
                                               prefer)
        self.speculative.record(plan.query.block_hashes, decision.worker_id)
        if count:
            self.commit(plan, decision)
        return decision

    def commit(self, plan: RoutePlan, decision: Decision) -> None:
        """The pick stands: counted."""
        self.observer.decision(self.policy.name, decision.reason)

    # -- 4b. the shared view --------------------------------------------------------------------
    def reservation(self, plan: RoutePlan, decision: Decision, request_id: str, tries: int) -> Reservation | None:
        """The reservation of the pick to make before forwarding (``tries`` made before it), or None
        when there is none to make: no shared view for this plan, or the attempts are used up."""
        if plan.versions is None or tries >= self.reservation_attempts:
            return None
        # NOTE: in flight from the pick on, so this router's next picks see it while it is reserved.
        ticket = self.start(plan, decision.worker_id)
        self.inflight.reservation_started(ticket)
        plan.reserve_sent_at = self.clock()
        q = plan.query
        c = plan.candidate(decision.worker_id)
        seen = (plan.versions.get(decision.worker_id, 0)
                if plan.conditional and tries < self.reservation_attempts - 1 else None)
        blocks = -(-q.prompt_len // q.block_size) if q.block_size else 0
        release = plan.release if plan.release != decision.worker_id else ""
        plan.release = ""
        self.note_reservation(decision.worker_id, uncached_tokens(c, q), blocks)
        return Reservation(plan.model_id, decision.worker_id, self.router_id, request_id, uncached_tokens(c, q), blocks,
                           seen, anchors_of(q.block_hashes[:MAX_CHAIN_BLOCKS]), release)

    def note_reservation(self, worker_id: str, prefill_tokens: int, blocks: int) -> None:
        """A pick of this router reserved (or being reserved) on ``worker_id``: the next folded pick's view
        counts it until an answer does (:meth:`tentative`)."""
        self._since_seen[worker_id] = _plus(self._since_seen.get(worker_id, Pending()), Pending(1, prefill_tokens,
                                                                                               blocks))

    def _with_own(self, p: Pending, worker_id: str, since: float) -> Pending:
        """The kv_service's pending picks of a worker plus this router's own that it may not hold yet
        (reserved after ``since``, when its answer was asked): the view counts each pick once."""
        n, tokens, blocks = self.inflight.reserved_since(worker_id, since)
        return Pending(p.requests + n, p.prefill_tokens + tokens, p.blocks + blocks, p.version) if n else p

    def reservation_answered(self, plan: RoutePlan, answer: ReservationAnswer) -> Decision | None:
        """The kv_service's answer to a reservation: None when reserved (forward the pick), else the
        policy's new pick with every candidate's pending picks as they are now (reserve it next)."""
        self.breaker.answered()
        if answer.reserved:
            self.reservation_settled(plan)
            return None
        assert plan.versions is not None
        if plan.ticket is not None:
            self.finish(plan.ticket)  # NOTE: the pick moves: its own share must not weigh on the re-pick
            self.speculative.forget(plan.query.block_hashes, plan.ticket.worker_id)
        positions = anchor_positions(min(len(plan.query.block_hashes), MAX_CHAIN_BLOCKS)) if answer.anchored else ()
        for c in plan.candidates:
            p = answer.pending.get(c.worker_id)
            if p is not None:
                c.pending = self._with_own(p, c.worker_id, plan.reserve_sent_at)
                plan.versions[c.worker_id] = p.version
            n = answer.anchored.get(c.worker_id, 0)
            if 0 < n <= len(positions) and positions[n - 1] + 1 > c.matched_blocks:
                c.matched_blocks = positions[n - 1] + 1  # another router's copy of the prefix
        # NOTE: the first pick's speculative record stays (its TTL ends it): removing one record's
        # entries would also remove those of every same-instant record of that worker.
        return self.pick(plan, count=False)

    def reservation_settled(self, plan: RoutePlan) -> None:
        """The plan's reservation was granted, or given up on (the kv_service did not answer)."""
        if plan.ticket is not None:
            self.inflight.reservation_settled(plan.ticket, self.clock())

    # -- 5. in-flight accounting ----------------------------------------------------------------
    def start(self, plan: RoutePlan, worker_id: str) -> Ticket:
        """The request goes to ``worker_id``: its uncached tokens wait for prefill there; the policy
        hears of it (``RouterPolicy.started``). Idempotent per plan and worker (a reserved pick is in
        flight from its reservation on); a plan's earlier ticket on another worker is finished."""
        t = plan.ticket
        if t is not None and not t.finished:
            if t.worker_id == worker_id:
                return t
            self.finish(t)
        q = plan.query
        chosen = plan.candidate(worker_id)
        blocks = -(-q.prompt_len // q.block_size) if q.block_size else 0
        plan.ticket = self.inflight.start(worker_id, uncached_tokens(chosen, q), blocks)
        self.policy.started(plan.ticket, q, chosen)
        return plan.ticket

    def prefilled(self, ticket: Ticket) -> None:
        """Its first token arrived."""
        if self.inflight.prefilled(ticket):
            self.policy.prefilled(ticket)

    def finish(self, ticket: Ticket, output_tokens: int = 0) -> None:
        """It ended (any way), after ``output_tokens`` tokens (0: failed or not known); idempotent."""
        if self.inflight.finish(ticket):
            self.policy.finished(ticket, output_tokens)



def _plus(a: Pending, b: Pending) -> Pending:
    return Pending(a.requests + b.requests, a.prefill_tokens + b.prefill_tokens, a.blocks + b.blocks, a.version)
