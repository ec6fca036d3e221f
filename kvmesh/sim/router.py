"""A simulated router: the live router's cores (its decide sequence, router/core/decide.py; RoutingCore,
WorkerSet, Attempts) on the virtual clock. Only the waits are the simulator's: the Lookup's and the
Reserve's round trips, the hops to and from the workers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from kvmesh.contract.errors import NotFound
from kvmesh.contract.index_protocol import IndexUnavailable, Reservation, ReservationAnswer, WorkerMatch
from kvmesh.contract.types import ModelSpec
from kvmesh.replay.records import RequestRecord
from kvmesh.router.core.attempts import Attempts
from kvmesh.router.core.decide import Decided, DecideSequence, NoWorker
from kvmesh.router.core.observer import CountingObserver
from kvmesh.router.core.policies import make_policy
from kvmesh.router.core.policies.base import Objectives
from kvmesh.router.core.routing import RoutingCore
from kvmesh.router.core.upstream import Failure
from kvmesh.router.core.worker_set import WorkerSet
from kvmesh.sim.config import SimConfig
from kvmesh.sim.events import EventQueue
from kvmesh.sim.index import SimIndex
from kvmesh.sim.worker import Attempt, SimWorker
from kvmesh.sim.workload import Workload


class RouterHost(Protocol):
    """What a router reads of the mesh it runs in (kvmesh/sim/mesh.py's Mesh)."""

    cfg: SimConfig
    q: EventQueue
    index: SimIndex
    spec: ModelSpec
    chains: list[list[bytes]]
    workers_by_id: dict[str, SimWorker]
    objectives: Objectives
    workload: Workload

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
        seq = self.sequence(rec)
        call = seq.lookup()
        outcome: list[WorkerMatch] | IndexUnavailable | None = None
        reserved = False
        if call is not None:
            # NOTE: answered at once; its latency is spent after the pick (below): the pick is in flight
            # from now, as live, where it is made when the answer arrives.
            try:
                if call.folded is not None:
                    outcome, reserved = mesh.index.lookup_reserve(call.model_id, call.block_hashes, call.folded)
                else:
                    outcome = mesh.index.lookup(call.model_id, call.block_hashes)
            except IndexUnavailable as exc:
                outcome = exc
        try:
            plan = seq.answered(outcome, 0.0, reserved)
        except NoWorker as exc:
            rec.failed = self.no_worker(exc)
            mesh.request_done(rec)
            return
        delay = mesh.cfg.lookup_latency_s if call is not None and plan.query.index_ok else 0.0
        seq.pick()
        assert seq.loop is not None
        if plan.versions is None:
            self._decided(rec, seq.commit(), delay)
        else:
            # NOTE: a pick the Lookup's folded reservation holds already sends no Reserve.
            mesh.expect(delay + (0.0 if seq.loop.folded else mesh.cfg.reserve_latency_s) + mesh.cfg.network_s)
            mesh.q.after(delay, self._next_reservation, rec, seq)

    def sequence(self, rec: RequestRecord) -> DecideSequence:
        """The request's decide sequence (router/core/decide.py, the live router's)."""
        return DecideSequence(self.core, self.spec, PromptLength(rec.prompt_len), self.workers.endpoints,
                              request_id=f"r{rec.index}.{rec.attempts + 1}", max_tokens=rec.output_len,
                              objectives=self.mesh.objectives, chain=self.mesh.chains[rec.index],
                              adapter=self.mesh.workload.requests[rec.index].adapter,
                              healthy=self.workers.healthy)

    def no_worker(self, exc: NoWorker) -> str:
        """The record's failure when no worker may take it."""
        return "no worker"

    def _next_reservation(self, rec: RequestRecord, seq: DecideSequence) -> None:
        """The shared view: the sequence's reservations, each Reserve landing in the index halfway through
        its round trip."""
        reservation = seq.reservation()
        if reservation is None:
            self._decided(rec, seq.commit(), 0.0)
            return
        cfg = self.mesh.cfg
        self.mesh.expect(cfg.reserve_latency_s + cfg.network_s)
        self.mesh.q.after(cfg.reserve_latency_s / 2, self._reserve, rec, seq, reservation)

    def _reserve(self, rec: RequestRecord, seq: DecideSequence, reservation: Reservation) -> None:
        mesh = self.mesh
        try:
            answer = mesh.index.write("reserve", reservation)
        except NotFound:  # NOTE: the worker left since the Lookup: forwarded, as live, unreserved
            mesh.q.after(mesh.cfg.reserve_latency_s / 2, self._unreserved, rec, seq)
            return
        mesh.index.traffic.reserves += 1
        mesh.q.after(mesh.cfg.reserve_latency_s / 2, self._answered, rec, seq, answer)

    def _unreserved(self, rec: RequestRecord, seq: DecideSequence) -> None:
        seq.unreserved()
        self._decided(rec, seq.commit(), 0.0)

    def _answered(self, rec: RequestRecord, seq: DecideSequence, answer: ReservationAnswer) -> None:
        if not seq.reserved(answer):
            self.conflicts += 1
        self._next_reservation(rec, seq)

    def _decided(self, rec: RequestRecord, decided: Decided, delay: float) -> None:
        attempts = Attempts(self.core, decided.plan, decided.decision, self.mesh.cfg.routing.max_attempts,
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


class PromptLength:
    """A prompt the router only measures: the simulator hands it the chain, never the tokens."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n
