"""A plan's types: :class:`PendingPlan` (waiting for its Lookup) and :class:`RoutePlan` (the candidates
the first pick and every retry choose from), made by router/core/routing.py's :class:`RoutingCore`.

No grpc, no redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.contract.index_protocol import Reservation
from kvmesh.contract.types import ModelSpec
from kvmesh.router.core.inflight import Ticket
from kvmesh.router.core.policies.base import NO_OBJECTIVES, Candidate, Objectives, RouteQuery
from kvmesh.router.core.upstream import WorkerEndpoint


@dataclass(slots=True, frozen=True)
class PendingPlan:
    """A plan waiting for its Lookup (:meth:`RoutingCore.prepare`)."""

    spec: ModelSpec
    token_ids: Sequence[int]
    chain: list[bytes]
    lookup: list[bytes] | None
    """The blocks to ask the index for; None = no Lookup (the policy reads no index, no full block,
    no index configured, or the breaker is open)."""
    index_ok: bool
    max_tokens: int
    asked_at: float = 0.0
    """The router's clock when the Lookup was asked: its own picks reserved since may be missing from it."""
    objectives: Objectives = NO_OBJECTIVES
    adapter: str = ""


@dataclass(slots=True)
class RoutePlan:
    """A request's tokens, chain and candidates; the first pick and every retry choose from it."""

    token_ids: Sequence[int]
    query: RouteQuery
    candidates: list[Candidate]
    endpoints: dict[str, WorkerEndpoint]
    model_id: str = ""
    versions: dict[str, int] | None = None
    """Per worker, its reservation count in the Lookup answer; None = no reservations for this plan (the
    policy does not read the shared view, it is off, or the index is down)."""
    conditional: bool = True
    """Reservations are conditional on ``versions`` (False: the Lookup was late, the pick blind: reserved
    unconditionally, so the other routers still see it)."""
    ticket: Ticket | None = None
    """The request's in-flight share on the worker it goes to (:meth:`RoutingCore.start`)."""
    reserve_sent_at: float = 0.0
    """When its last reservation was sent (the refusal's answer may miss this router's picks reserved since)."""
    answered: bool = False
    """The index answered this plan's Lookup: its candidates' ``indexed_blocks`` are the index's word (the
    miss audit's prediction, router/core/audit.py)."""
    prefill_candidates: list[Candidate] = field(default_factory=list)
    """Prefill/decode disaggregation: the prefill workers (``candidates`` then holds the workers that decode)."""
    folded: Reservation | None = None
    """The pick this router made from its own view and reserved with the Lookup (:meth:`RoutingCore.tentative`)."""
    folded_reserved: bool = False
    """The kv_service reserved it (False: refused, or not known: the Lookup failed)."""
    release: str = ""
    """The worker the folded reservation is to be dropped from by the plan's next reservation ("" = none)."""

    def candidate(self, worker_id: str) -> Candidate:
        return next(c for c in self.candidates if c.worker_id == worker_id)
