"""A request this router picked a worker for and another front forwards (``kvmesh epp``, docs/epp.md): the
same in-flight accounting, policy hooks and miss audit as a request the router forwards itself, fed by what
that front learns from the response path."""

from __future__ import annotations

import logging

from kvmesh.contract.types import Usage
from kvmesh.router.core.plan import RoutePlan
from kvmesh.router.core.policies.base import Decision
from kvmesh.router.core.routing import RoutingCore
from kvmesh.router.request.settle import Settle

log = logging.getLogger("kvmesh.router")


class Handoff:
    """Every method is idempotent past the end."""

    __slots__ = ("core", "settle", "plan", "worker_id", "request_id", "ticket", "_ended")

    def __init__(self, core: RoutingCore, settle: Settle, plan: RoutePlan, decision: Decision,
                 request_id: str) -> None:
        self.core = core
        self.settle = settle
        self.plan = plan
        self.worker_id = decision.worker_id
        self.request_id = request_id
        self.ticket = core.start(plan, decision.worker_id)
        self._ended = False

    def served_by(self, worker_id: str) -> None:
        """The worker that served was another than the pick (the gateway went down the fallbacks)."""
        if not self._ended and worker_id != self.worker_id and worker_id in self.plan.endpoints:
            self.worker_id = worker_id
            self.ticket = self.core.start(self.plan, worker_id)

    def first_token(self) -> None:
        if not self._ended:
            self.core.prefilled(self.ticket)

    def finished(self, usage: Usage | None = None, outcome: str = "ok") -> None:
        """It ended: ``usage`` from the response (None: not seen, not audited), ``outcome`` for the log."""
        if self._ended:
            return
        self._ended = True
        self.core.finish(self.ticket, usage.completion_tokens if usage is not None else 0)
        if usage is not None:
            self.settle.audit(self.plan, self.worker_id, usage)
        u = usage or Usage()
        log.info("request %s: %s on %s (handed off): prompt %d cached %d completion %d tokens", self.request_id,
                 outcome, self.worker_id, u.prompt_tokens, u.cached_tokens, u.completion_tokens)
