"""The index in the simulator: the kv_service core over its in-memory store, on the virtual clock.

With ``--read-replica-lag S`` the routers' Lookups are answered by a replica (the live
``kv_service --read-replicas``): a second kv_service core that applies every write of the primary
(registrations, heartbeats, event messages, snapshots, reservations) ``S`` seconds after the primary
did, with the primary's timestamps, as a Redis replica replays its master's effects. Writes,
Reserve and discovery (ListWorkers) stay on the primary, as they do live.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh.contract.errors import KVMeshError
from kvmesh.contract.index_protocol import IndexUnavailable, Reservation, WorkerMatch
from kvmesh.kv_service.service import KVService, run_now
from kvmesh.kv_service.stores import make_store
from kvmesh.router.core.upstream import WorkerEndpoint
from kvmesh.sim.config import MODEL_ID, SimConfig
from kvmesh.sim.events import EventQueue


@dataclass(slots=True)
class IndexTraffic:
    """What reached the index in one run: the kv_service's (and its Redis') load, counted where
    the index receives it (lost messages are not counted). docs/deploy.md sizes Redis from it."""

    event_messages: int = 0
    """PublishEvents messages with events or a load (snapshots not included)."""
    load_only_messages: int = 0
    """Of those, the messages with a load and no event."""
    blocks_stored: int = 0
    """Block hashes in BlockStored events (in blocks of the run's block size)."""
    blocks_removed: int = 0
    all_cleared: int = 0
    max_message_blocks: int = 0
    """The most block hashes one message carried."""
    snapshots: int = 0
    snapshot_blocks: int = 0
    heartbeats: int = 0
    routed_requests: int = 0
    """Requests a router planned (one per request; retries are not planned again)."""
    lookups: int = 0
    """Lookups the routers asked (those past the router's deadline included: the index served them)."""
    lookup_chain_blocks: int = 0
    """Block hashes in those Lookups' chains."""
    reserves: int = 0
    """Reserve calls of the shared router view (the refused ones included)."""

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


class SimIndex:
    """KVService over MemoryIndex on the virtual clock, with the router's Lookup deadline."""

    def __init__(self, q: EventQueue, cfg: SimConfig) -> None:
        self.q = q
        self.cfg = cfg
        self.svc = KVService(make_store("memory"), cfg.index, clock=lambda: int(q.now * 1000))
        self.traffic = IndexTraffic()
        self.replica: KVService | None = None
        """Answers the Lookups ``read_replica_lag_s`` behind the primary (None: the primary does)."""
        self._lag_ms = round(cfg.read_replica_lag_s * 1000)
        self._replayed_at = 0
        self._log: deque[tuple[int, str, tuple[Any, ...]]] = deque()
        """The primary's writes the replica has not applied yet: (when, KVService method, arguments)."""
        if cfg.read_replica_lag_s > 0:
            self.replica = KVService(make_store("memory"), cfg.index, clock=lambda: self._replayed_at)

    def write(self, method: str, *args: Any) -> Any:
        """A write to the index (a KVService call on the primary; raises what it raises), replayed on the
        replica ``read_replica_lag_s`` later."""
        result = run_now(getattr(self.svc, method)(*args))
        if self.replica is not None:
            self._log.append((int(self.q.now * 1000), method, args))
        return result

    def _catch_up(self, replica: KVService) -> None:
        horizon = int(self.q.now * 1000) - self._lag_ms
        log = self._log
        while log and log[0][0] <= horizon:
            self._replayed_at, method, args = log.popleft()
            # NOTE: the primary applied it (a refused write is not logged); the replica, in the primary's
            # state of that instant, applies it the same way
            with contextlib.suppress(KVMeshError):
                run_now(getattr(replica, method)(*args))

    def lookup(self, model_id: str, chain: Sequence[bytes]) -> list[WorkerMatch]:
        self.traffic.lookups += 1
        self.traffic.lookup_chain_blocks += len(chain)
        if self.cfg.lookup_latency_s * 1000 > self.cfg.routing.lookup_timeout_ms:
            raise IndexUnavailable("Lookup past its deadline (simulated)")
        replica = self.replica
        if replica is None:
            return run_now(self.svc.lookup(model_id, chain))
        self._catch_up(replica)
        self._replayed_at = int(self.q.now * 1000)  # NOTE: the Lookup itself runs on the replica's clock: now
        return run_now(replica.lookup(model_id, chain))

    def lookup_reserve(self, model_id: str, chain: Sequence[bytes],
                       reservation: Reservation) -> tuple[list[WorkerMatch], bool]:
        """The Lookup with the router's folded reservation: one round trip; the reservation is a write on
        the primary (replayed on the replica like a Reserve's)."""
        if self.replica is None:
            self.traffic.lookups += 1
            self.traffic.lookup_chain_blocks += len(chain)
            if self.cfg.lookup_latency_s * 1000 > self.cfg.routing.lookup_timeout_ms:
                raise IndexUnavailable("Lookup past its deadline (simulated)")
            return run_now(self.svc.lookup_reserve(model_id, chain, reservation))
        found = self.lookup(model_id, chain)
        try:
            return found, self.write("reserve", reservation).reserved
        except KVMeshError:
            return found, False

    def endpoints(self) -> list[WorkerEndpoint]:
        """ListWorkers: the live workers of the model, with their last reported load."""
        now_ms = int(self.q.now * 1000)
        return [WorkerEndpoint(w.registration.worker_id, w.registration.address, w.load, w.registration.role)
                for w in run_now(self.svc.index.workers(now_ms)) if w.registration.model_id == MODEL_ID]
