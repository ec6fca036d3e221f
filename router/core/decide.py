"""The decide sequence: chain -> Lookup -> candidates -> roles -> pick -> reservations -> commit -> P/D.

One sequence for every front that routes: the live router's request path (router/request/decide.py awaits its
calls), the endpoint picker (the same path, handing the pick to a gateway) and the simulator, plain and P/D
(kvmesh/sim/router.py, kvmesh/sim/pd.py: each call scheduled on the virtual clock). Nothing here awaits or
sends: a step returns the call to make (:class:`LookupCall`, a :class:`Reservation`) and the driver hands the
answer to the next step, so the drivers differ only in how long a call takes.

The steps, in order::

    seq = DecideSequence(core, spec, token_ids, endpoints, ...)
    call = seq.lookup()                 # None: no Lookup (no index, no full block, breaker open)
    seq.answered(outcome, seconds, reserved)   # the Lookup's answer or IndexUnavailable
    seq.pick()
    while (r := seq.reservation()) is not None:
        seq.reserved(answer)            # or seq.unreserved() when the kv_service did not answer
    decided = seq.commit()

Roles are split before any pick, the tentative one that rides on the Lookup included: a prefill-only
worker is never the pick a request is reserved on.

No grpc, no redis, no clock of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvmesh.contract.errors import Unavailable
from kvmesh.contract.index_protocol import IndexUnavailable, Reservation, ReservationAnswer, WorkerMatch
from kvmesh.contract.kv_transfer import serves_decode
from kvmesh.contract.types import ModelSpec
from kvmesh.router.core.pd import PDDecision, disaggregated_fleet, split_roles
from kvmesh.router.core.plan import PendingPlan, RoutePlan
from kvmesh.router.core.policies.base import NO_OBJECTIVES, Candidate, Decision, Objectives, RouteQuery
from kvmesh.router.core.reservation_loop import ReservationLoop
from kvmesh.router.core.routing import RoutingCore
from kvmesh.router.core.upstream import PrefixIndex, WorkerEndpoint


class NoWorker(Unavailable):
    """No worker may take the request: ``kind`` is ``none`` (no candidate at all), ``subset`` (none in a
    gateway's subset) or ``decode`` (only prefill workers are live)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class SplitDecider(Protocol):
    """Whether a prefill worker takes the prompt (router/core/pd.py's PDDecider; the simulator's peers)."""

    def decide(self, q: RouteQuery, decode: Candidate, prefills: list[Candidate],
               decodes: Sequence[Candidate] = ()) -> PDDecision: ...


@dataclass(slots=True, frozen=True)
class LookupCall:
    """The one Lookup of a request: ``folded`` is the pick reserved in the same call (``--fold-reserve``)."""

    model_id: str
    block_hashes: Sequence[bytes]
    folded: Reservation | None


@dataclass(slots=True)
class Decided:
    """What a request is forwarded with: its plan, the pick, and (a fleet with roles) the P/D decision."""

    plan: RoutePlan
    decision: Decision
    pd: PDDecision | None = None
    """None: the fleet has no roles (or ``--pd-mode`` makes none); else the decision, prefill worker or not."""


@dataclass(slots=True, frozen=True)
class Fleet:
    """The roles a decide sequence splits by: worker id -> role; ``mode`` is ``--pd-mode``."""

    roles: Mapping[str, str]
    mode: str = "auto"

    def disaggregated(self) -> bool:
        return disaggregated_fleet(list(self.roles.values()), self.mode)


class DecideSequence:
    """One request's decision, step by step (module docstring).

    Args:
        core: the router's decision state.
        spec: the model's spec (block size, hash).
        token_ids: the prompt (the simulator passes a stand-in with a length, and ``chain``).
        endpoints: the workers discovery knows.
        request_id: the id the worker sees; the reservations name it ("" = none folded into the Lookup).
        objectives: the request's latency objectives (none by default).
        adapter: the LoRA adapter the request runs under ("" = the base model).
        have_index: an index is configured.
        adopt: a worker the Lookup names that discovery has not listed joins (discovery from the index).
        healthy: whether a worker is free of a recent failure mark.
        fleet: the workers' roles (None: no roles, no P/D).
        decider: the P/D decision, for a fleet with roles.
        only: ``only(worker_id, address)``: the workers the pick may choose (a gateway's subset).
    """

    __slots__ = ("core", "spec", "token_ids", "endpoints", "request_id", "cache_salt", "max_tokens", "objectives", "adapter", "chain",
                 "have_index", "adopt", "healthy", "split", "dynamic", "decider", "only", "pending", "folded",
                 "plan", "loop")

    def __init__(self, core: RoutingCore, spec: ModelSpec, token_ids: Sequence[int],
                 endpoints: Iterable[WorkerEndpoint], *, request_id: str = "", cache_salt: str = "",
                 max_tokens: int = 0, objectives: Objectives = NO_OBJECTIVES, adapter: str = "",
                 chain: list[bytes] | None = None,
                 have_index: bool = True, adopt: bool = True, healthy: Callable[[str], bool] = lambda _w: True,
                 fleet: Fleet | None = None, decider: SplitDecider | None = None,
                 only: Callable[[str, str], bool] | None = None) -> None:
        self.core = core
        self.spec = spec
        self.token_ids = token_ids
        self.endpoints = list(endpoints)
        self.request_id = request_id
        self.cache_salt = cache_salt
        self.max_tokens = max_tokens
        self.objectives = objectives
        self.adapter = adapter
        self.chain = chain
        self.have_index = have_index
        self.adopt = adopt
        self.healthy = healthy
        self.split: Mapping[str, str] | None = fleet.roles if fleet is not None and fleet.disaggregated() else None
        """The roles to split the candidates by; None = every worker decodes and none prefills for another."""
        self.dynamic = fleet is not None and fleet.mode == "dynamic"
        self.decider = decider
        self.only = only
        self.pending: PendingPlan | None = None
        self.folded: Reservation | None = None
        self.plan: RoutePlan | None = None
        self.loop: ReservationLoop | None = None

    # -- 1. the Lookup ----------------------------------------------------------------------------
    def lookup(self) -> LookupCall | None:
        """Hashes the prompt; the Lookup to make, or None when none is made (the next step is then
        ``answered(None)``). The Lookup carries this router's tentative pick, reserved with it, when the
        shared view folds reservations (``RoutingCore.tentative``), picked among the workers that decode."""
        core = self.core
        self.pending = pending = core.prepare(self.spec, self.token_ids, self.have_index, cache_salt=self.cache_salt,
                                              chain=self.chain, max_tokens=self.max_tokens,
                                              objectives=self.objectives, adapter=self.adapter)
        if pending.lookup is None:
            return None
        if self.request_id:
            decoders = self.endpoints if self.split is None else [
                e for e in self.endpoints if serves_decode(self.split.get(e.worker_id, "both"))]
            self.folded = core.tentative(pending, decoders, self.request_id, healthy=self.healthy)
        return LookupCall(self.spec.model_id, pending.lookup, self.folded)

    def answered(self, outcome: Sequence[WorkerMatch] | IndexUnavailable | None, seconds: float = 0.0,
                 reserved: bool = False) -> RoutePlan:
        """The Lookup's answer (or the IndexUnavailable it raised; None when none was made) and whether its
        folded reservation was made: the candidates, split by role. Raises :class:`NoWorker`."""
        assert self.pending is not None, "lookup() first"
        plan = self.core.complete(self.pending, self.endpoints, outcome, seconds, adopt=self.adopt,
                                  healthy=self.healthy, folded=self.folded, folded_reserved=reserved)
        self.plan = plan
        if self.only is not None and plan.candidates:
            plan.candidates = [c for c in plan.candidates if self.only(c.worker_id, c.address)]
            if not plan.candidates:
                raise NoWorker("subset", "no ready worker is in the gateway's subset of endpoints")
        if not plan.candidates:
            raise NoWorker("none", f"no worker is available for model {self.spec.model_id!r}")
        if self.split is not None:
            # NOTE: decode first: the pick, its reservation and any retry are among the workers that decode.
            plan.candidates, plan.prefill_candidates = split_roles(plan.candidates, dict(self.split), self.dynamic)
            if not plan.candidates:
                raise NoWorker("decode", f"no decode worker is available for model {self.spec.model_id!r} "
                                         "(only prefill workers are live)")
        return plan

    # -- 2. the pick and its reservations ---------------------------------------------------------------
    def pick(self) -> Decision:
        """The policy's pick. A pick to be reserved is in flight from now (this router's next picks see it
        while its Reserve travels)."""
        plan = self.plan
        assert plan is not None, "answered() first"
        decision = self.core.pick(plan, count=False)
        if plan.versions is not None:
            self.core.start(plan, decision.worker_id)
        self.loop = ReservationLoop(self.core, plan, decision, self.request_id)
        return decision

    def reservation(self) -> Reservation | None:
        """The Reserve to send now, or None: the pick stands."""
        assert self.loop is not None, "pick() first"
        return self.loop.next()

    def reserved(self, answer: ReservationAnswer) -> bool:
        """The kv_service's answer to the last reservation; False when another router got there first (the
        policy picked again: the next reservation is that pick's)."""
        assert self.loop is not None
        return self.loop.answered(answer)

    def unreserved(self) -> None:
        """The kv_service did not answer the Reserve: the pick is forwarded as it is."""
        assert self.loop is not None
        self.loop.unanswered()

    # -- 3. the pick stands -------------------------------------------------------------------------------
    def commit(self) -> Decided:
        """The pick is counted, and for a fleet with roles the P/D decision made on it."""
        loop, plan = self.loop, self.plan
        assert loop is not None and plan is not None
        decision = loop.decision
        self.core.commit(plan, decision)
        pd = None
        if self.split is not None and self.decider is not None:
            pd = self.decider.decide(plan.query, plan.candidate(decision.worker_id), plan.prefill_candidates,
                                     plan.candidates)
        return Decided(plan, decision, pd)


def plan_now(core: RoutingCore, spec: ModelSpec, token_ids: Sequence[int], endpoints: Iterable[WorkerEndpoint],
             index: PrefixIndex | None, *, cache_salt: str = "", adopt: bool = True,
             healthy: Callable[[str], bool] = lambda _w: True, chain: list[bytes] | None = None,
             max_tokens: int = 0, request_id: str = "", objectives: Objectives = NO_OBJECTIVES,
             adapter: str = "") -> RoutePlan:
    """The sequence's first steps against a synchronous index (``PrefixIndex``), answered at once: the plan a
    pick is made on, or one without candidates. For the tools that plan outside a request's life (the
    information limit, the tests)."""
    seq = DecideSequence(core, spec, token_ids, endpoints, request_id=request_id, cache_salt=cache_salt,
                         max_tokens=max_tokens, objectives=objectives, adapter=adapter, chain=chain,
                         have_index=index is not None,
                         adopt=adopt,
                         healthy=healthy)
    call = seq.lookup()
    outcome: Sequence[WorkerMatch] | IndexUnavailable | None = None
    reserved = False
    t0 = core.clock()
    if call is not None:
        assert index is not None
        try:
            if call.folded is not None:
                outcome, reserved = index.lookup_reserve(call.model_id, call.block_hashes, call.folded)
            else:
                outcome = index.lookup(call.model_id, call.block_hashes)
        except IndexUnavailable as exc:
            outcome = exc
    try:
        return seq.answered(outcome, core.clock() - t0, reserved)
    except NoWorker:
        assert seq.plan is not None
        return seq.plan
