"""The peers' multi-router modes on the virtual clock: what one router learns of the others.

A policy says which mode its original has (router/core/policies/base.py); the simulator drives it:

- **replica sync** (``RouterPolicy.replica_sync``; Dynamo's ``--router-replica-sync``): every event a
  router's policy publishes waits in that router's batch until the policy's batch period has passed
  since the batch's first event, or until the batch is full; then the batch reaches every other
  router one network hop later, in publication order. On by default with several routers
  (``--no-replica-sync``: each router keeps its own state, as Dynamo without the flag).
- **load scrapes** (``RouterPolicy.scrape_interval_s``; llm-d's 50 ms metrics refresh): each router
  reads every live worker's load on its own period (routers out of phase by an equal share of it) and
  has the figures one network hop later. A scrape is the load the worker would report at that instant.

Every other policy's routers share nothing but the index (SGLang's trees and counters, Preble's
scheduler: one per router). This module only schedules: the policies are the production classes.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.contract.types import Load
from kvmesh.sim.config import SimConfig
from kvmesh.sim.events import EventQueue
from kvmesh.sim.router import SimRouter
from kvmesh.sim.worker import SimWorker


class ReplicaSync:
    """Batches each router's replica events and delivers them to its peers."""

    def __init__(self, q: EventQueue, cfg: SimConfig, routers: Sequence[SimRouter]) -> None:
        self.q = q
        self.cfg = cfg
        self.routers = list(routers)
        self._batches: list[list[object]] = [[] for _ in self.routers]
        self._opened: list[float] = [0.0] * len(self.routers)
        self.batches_sent = 0
        for i, r in enumerate(self.routers):
            r.core.policy.sync_replicas(f"router-{i}", lambda event, i=i: self._publish(i, event))

    def _publish(self, sender: int, event: object) -> None:
        batch = self._batches[sender]
        batch.append(event)
        period, limit = type(self.routers[sender].core.policy).replica_batch
        if len(batch) >= limit:
            self._flush(sender, self._opened[sender])
        elif len(batch) == 1:
            q = self.q
            self._opened[sender] = q.now
            q.after(period, self._flush, sender, q.now)

    def _flush(self, sender: int, opened: float) -> None:
        batch = self._batches[sender]
        if not batch or opened != self._opened[sender]:
            return  # NOTE: already sent full, or a later batch's timer is pending
        self._batches[sender] = []
        self._opened[sender] = -1.0
        self.batches_sent += 1
        hop = self.cfg.network_s
        for i, r in enumerate(self.routers):
            if i != sender:
                self.q.after(hop, r.core.policy.apply_replica_events, batch)


class LoadScrapes:
    """One router's periodic scrape of every live worker's load."""

    def __init__(self, q: EventQueue, cfg: SimConfig, workers: Sequence[SimWorker], router: SimRouter,
                 phase: float) -> None:
        self.q = q
        self.cfg = cfg
        self.workers = workers
        self.router = router
        self.phase = phase
        self.interval = type(router.core.policy).scrape_interval_s

    def start(self) -> None:
        self.q.at(self.phase, self._scrape)

    def _scrape(self) -> None:
        # NOTE: one delivery event for the whole scrape: the same order as one event per worker
        # (theirs were consecutive in the queue), a ninth of the events.
        loads = [(w.worker_id, w.load_now()) for w in self.workers if w.up and w.engine is not None]
        if loads:
            self.q.after(self.cfg.network_s, self._deliver, loads)
        self.q.after(self.interval, self._scrape)

    def _deliver(self, loads: list[tuple[str, Load]]) -> None:
        scraped = self.router.core.policy.scraped
        for worker_id, load in loads:
            scraped(worker_id, load)


class PeerModes:
    """The multi-router modes of a run's policy: replica sync and load scrapes, where it has them."""

    def __init__(self, q: EventQueue, cfg: SimConfig, routers: Sequence[SimRouter],
                 workers: Sequence[SimWorker]) -> None:
        policy = type(routers[0].core.policy)
        self.sync = ReplicaSync(q, cfg, routers) if policy.replica_sync and cfg.replica_sync and len(routers) > 1 \
            else None
        n = len(routers)
        self.scrapes = [LoadScrapes(q, cfg, workers, r, i * policy.scrape_interval_s / n)
                        for i, r in enumerate(routers)] if policy.scrape_interval_s > 0 else []

    def start(self) -> None:
        for s in self.scrapes:
            s.start()
