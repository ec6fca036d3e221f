"""One request's reservation loop in the shared router view (docs/router.md, "Several routers"),
without its I/O: the live router awaits each Reserve (router/model_router.py), the simulator schedules
it on its clock (kvmesh/sim/router.py). The decisions it steps through are :class:`RoutingCore`'s
(router/core/routing.py).

This module imports neither grpc nor redis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.contract.index_protocol import Reservation, ReservationAnswer
    from kvmesh.router.core.plan import RoutePlan
    from kvmesh.router.core.policies.base import Decision
    from kvmesh.router.core.routing import RoutingCore


class ReservationLoop:
    """One request's reservation loop in the shared router view, without its I/O.

    The caller sends each :meth:`next` reservation to the kv_service and hands back its answer
    (:meth:`answered`) or its failure (:meth:`unanswered`) until :meth:`next` answers None; then
    :attr:`decision` is the pick to forward. The live router awaits each Reserve; the simulator
    schedules it on its virtual clock: one loop for both.
    """

    __slots__ = ("core", "plan", "decision", "request_id", "tries", "conflicts", "folded", "_done")

    def __init__(self, core: RoutingCore, plan: RoutePlan, decision: Decision, request_id: str) -> None:
        self.core = core
        self.plan = plan
        self.decision = decision
        self.request_id = request_id
        self.tries = 0
        self.conflicts = 0
        """Reservations refused because another router reserved the worker first."""
        self._done = plan.versions is None
        f = plan.folded
        self.folded = (not self._done and f is not None and plan.folded_reserved and f.worker_id == decision.worker_id
                       and f.request_id == request_id)
        """The Lookup's folded reservation is this pick's (RoutingCore.tentative): nothing to send."""
        if self.folded:
            assert f is not None
            plan.release = ""
            core.note_reservation(f.worker_id, f.prefill_tokens, f.blocks)
            ticket = core.start(plan, decision.worker_id)
            core.inflight.reservation_started(ticket)
            plan.reserve_sent_at = core.clock()
            core.reservation_settled(plan)
            self._done = True

    def next(self) -> Reservation | None:
        """The reservation to make now, or None: the pick stands (reserved, given up on, or no reservations
        for this plan)."""
        if self._done:
            return None
        r = self.core.reservation(self.plan, self.decision, self.request_id, self.tries)
        if r is None:
            self._done = True
        return r

    def answered(self, answer: ReservationAnswer) -> bool:
        """The kv_service's answer; True when it reserved the pick, False when the policy picked again
        (the next reservation is that pick's)."""
        again = self.core.reservation_answered(self.plan, answer)
        if again is None:
            self._done = True
            return True
        self.decision, self.tries = again, self.tries + 1
        self.conflicts += 1
        return False

    def unanswered(self) -> None:
        """The kv_service did not answer (or the worker left it): the pick is forwarded as it is."""
        self.core.reservation_settled(self.plan)
        self._done = True
