"""A simulated router: the live router's cores (RoutingCore, its ReservationLoop, WorkerSet,
Attempts) on the virtual clock. Only the waits are the simulator's: the Lookup's and the Reserve's
round trips, the hops to and from the workers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from kvmesh.contract.errors import NotFound
from kvmesh.contract.index_protocol import Reservation, ReservationAnswer
from kvmesh.contract.types import ModelSpec
from kvmesh.replay.records import RequestRecord
from kvmesh.router.core.attempts import Attempts
from kvmesh.router.core.policies import make_policy
from kvmesh.router.core.policies.base import Decision
from kvmesh.router.core.reservation_loop import ReservationLoop
from kvmesh.router.core.routing import CountingObserver, RoutePlan, RoutingCore
from kvmesh.router.core.upstream import Failure
from kvmesh.router.core.worker_set import WorkerSet
from kvmesh.sim.config import SimConfig
from kvmesh.sim.events import EventQueue
from kvmesh.sim.index import SimIndex
from kvmesh.sim.worker import Attempt, SimWorker


class RouterHost(Protocol):
    """What a router reads of the mesh it runs in (kvmesh/sim/mesh.py's Mesh)."""

    cfg: SimConfig
    q: EventQueue
    index: SimIndex
    spec: ModelSpec
    chains: list[list[bytes]]
    workers_by_id: dict[str, SimWorker]

    def request_done(self, rec: RequestRecord) -> None: ...

    def expect(self, dt: float) -> None: ...

    def forward(self, dt: float, submit: Callable, *args) -> None: ...


class SimRouter:
    """One router: the live router's cores (RoutingCore, WorkerSet, Attempts) on the virtual clock;
    discovery polls the index every ``discovery_s``."""

    def __init__(self, mesh: RouterHost, index: int) -> None:
        self.mesh = mesh
        cfg = mesh.cfg
        r = cfg.routing
        pc = replace(r.policy_config, seed=cfg.seed * 1000 + index, clock=lambda: mesh.q.now)
        self.observer = CountingObserver()
        self.core = RoutingCore(make_policy(r.policy, pc), speculative_ttl_s=r.speculative_ttl_s,
                                index_retry_s=r.index_retry_s, clock=lambda: mesh.q.now, observer=self.observer,
                                shared_view=r.shared_view, router_id=f"router-{index}",
                                reservation_attempts=r.reservation_attempts, fold_reserve=r.fold_reserve)
        self.workers = WorkerSet(r.unhealthy_s, clock=lambda: mesh.q.now)
        self.spec = mesh.spec
        self.conflicts = 0
        """Reservations refused because another router reserved the worker first."""

    def discover(self) -> None:
        self.workers.update(self.mesh.index.endpoints())
        self.mesh.q.after(self.mesh.cfg.routing.discovery_interval_s, self.discover)

    def route(self, rec: RequestRecord) -> None:
        mesh = self.mesh
        mesh.index.traffic.routed_requests += 1
        chain = mesh.chains[rec.index]
        rid = f"r{rec.index}.{rec.attempts + 1}"
        plan = self.core.plan(self.spec, _Length(rec.prompt_len), self.workers.endpoints, mesh.index, chain=chain,
                              healthy=self.workers.healthy, max_tokens=rec.output_len, request_id=rid)
        if not plan.candidates:
            rec.failed = "no worker"
            mesh.request_done(rec)
            return
        delay = mesh.cfg.lookup_latency_s if self.core.wants_index(chain) and plan.query.index_ok else 0.0
        decision = self.core.pick(plan, count=False)
        if plan.versions is None:
            self._decided(rec, plan, decision, delay)
        else:
            # NOTE: the Lookup was answered at once and its latency is spent after the pick: the
            # pick is in flight from now, as live, where it is made when the answer arrives.
            self.core.start(plan, decision.worker_id)
            loop = ReservationLoop(self.core, plan, decision, rid)
            # NOTE: a pick the Lookup's folded reservation holds already sends no Reserve.
            mesh.expect(delay + (0.0 if loop.folded else mesh.cfg.reserve_latency_s) + mesh.cfg.network_s)
            mesh.q.after(delay, self._next_reservation, rec, loop)

    def _next_reservation(self, rec: RequestRecord, loop: ReservationLoop) -> None:
        """The shared view: the core's reservation loop, each Reserve landing in the index halfway
        through its round trip."""
        reservation = loop.next()
        if reservation is None:
            self._decided(rec, loop.plan, loop.decision, 0.0)
            return
        cfg = self.mesh.cfg
        self.mesh.expect(cfg.reserve_latency_s + cfg.network_s)
        self.mesh.q.after(cfg.reserve_latency_s / 2, self._reserve, rec, loop, reservation)

    def _reserve(self, rec: RequestRecord, loop: ReservationLoop, reservation: Reservation) -> None:
        mesh = self.mesh
        try:
            answer = mesh.index.write("reserve", reservation)
        except NotFound:  # NOTE: the worker left since the Lookup: forwarded, as live, unreserved
            mesh.q.after(mesh.cfg.reserve_latency_s / 2, self._unreserved, rec, loop)
            return
        mesh.index.traffic.reserves += 1
        mesh.q.after(mesh.cfg.reserve_latency_s / 2, self._answered, rec, loop, answer)

    def _unreserved(self, rec: RequestRecord, loop: ReservationLoop) -> None:
        loop.unanswered()
        self._decided(rec, loop.plan, loop.decision, 0.0)

    def _answered(self, rec: RequestRecord, loop: ReservationLoop, answer: ReservationAnswer) -> None:
        if not loop.answered(answer):
            self.conflicts += 1
        self._next_reservation(rec, loop)

    def _decided(self, rec: RequestRecord, plan: RoutePlan, decision: Decision, delay: float) -> None:
        self.core.commit(plan, decision)
        attempts = Attempts(self.core, plan, decision, self.mesh.cfg.routing.max_attempts,
                            rec.arrival + self.mesh.cfg.routing.request_timeout_s, self.workers.mark_unhealthy)
        self._send(rec, attempts, delay)

    def _send(self, rec: RequestRecord, attempts: Attempts, delay: float) -> None:
        decision = attempts.next(self.mesh.q.now)
        if decision is None:
            rec.failed = f"no worker could take it after {rec.attempts} attempt(s)"
            self.mesh.request_done(rec)
            return
        ticket = self.core.start(attempts.plan, decision.worker_id)
        rec.attempts += 1
        rec.worker = decision.worker_id
        a = Attempt(rec, self, attempts, ticket, f"r{rec.index}.{rec.attempts}")
        worker = self.mesh.workers_by_id[decision.worker_id]
        self.mesh.forward(delay + self.mesh.cfg.network_s, worker.submit, a)

    def first_token(self, a: Attempt) -> None:
        self.core.prefilled(a.ticket)

    def finished(self, a: Attempt) -> None:
        self.core.finish(a.ticket, a.record.completion_tokens)
        self.mesh.request_done(a.record)

    def refused(self, a: Attempt, why: str) -> None:
        """INVALID_ARGUMENT from the worker: never retried."""
        self.core.finish(a.ticket)
        a.record.failed = f"refused: {why}"
        self.mesh.request_done(a.record)

    def worker_failed(self, a: Attempt, worker_id: str) -> None:
        """UNAVAILABLE from the worker: before the first token the next worker, after it a failure."""
        self.core.finish(a.ticket)
        rec = a.record
        if rec.first_token is not None:
            self.workers.mark_unhealthy(worker_id)
            rec.failed = f"worker {worker_id} failed mid-stream"
            self.mesh.request_done(rec)
            return
        if a.attempts.failed(worker_id, Failure.UNAVAILABLE, "the worker is down (simulated)"):
            self._send(rec, a.attempts, 0.0)
        else:
            rec.failed = f"no worker could take it after {rec.attempts} attempt(s)"
            self.mesh.request_done(rec)


class _Length:
    """A prompt the router only measures: the simulator hands it the chain, never the tokens."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n
