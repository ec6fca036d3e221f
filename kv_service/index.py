"""The KV-block index: types and the one interface both stores implement.

Semantics (docs/kv-service.md):
- per block hash and tier (device, host): the set of workers holding it there; refcount = number of
  live holders; the entry is gone when the last holder drops it;
- per worker and tier: an LRU order of its blocks (by last stored), capped at its ``num_blocks``
  (device) and its host tier's size (host); its load, lease, epoch and last applied seq;
- a Lookup answers, per worker, its device prefix of the chain and how far its host tier continues
  it (kv_service/prefix_search.py);
- a worker's events apply only in seq order within its epoch; a gap or a newer epoch answers
  RESYNC and changes nothing; a snapshot replaces the worker's set;
- per worker: the routers' pending picks (the shared router view, docs/router.md "Several
  routers"): a reserved pick counts in every Lookup until a load report of the worker covers it
  (the report lists the pick's request as admitted; or, from a worker that lists no admissions,
  the report arrived ``grace_ms`` or more after the pick), ``ttl_ms`` at most; a re-registration
  drops them (the requests died with the process).

Every method is a coroutine (the Redis store awaits its round trips; the memory store never
suspends) and atomic, except that a store may apply one big event batch in several bounded steps
(store_redis.py: lookups are answered between them; each step leaves the index in the state of a
prefix of the worker's event stream). ``now_ms`` is passed in so both stores and all replicas
agree on time and tests control it. This module imports neither grpc nor redis.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvmesh.contract.index_protocol import (
    Registration,
    Reservation,
    ReservationAnswer,
    WorkerInfo,
    WorkerMatch,
)
from kvmesh.contract.types import KVCacheEvent, Load, ModelSpec, Tier
from kvmesh.kv_service.config import PendingConfig

FLUSHED = "the index dropped this worker's blocks (FlushWorker)"
"""The reason of the RESYNC a flushed worker's event batches get until its snapshot arrives."""


class Action(enum.IntEnum):
    ACK = 1
    RESYNC = 2


@dataclass(slots=True, frozen=True)
class PublishResult:
    action: Action
    reason: str = ""


@dataclass(slots=True)
class IndexStats:
    live_workers: int
    indexed_blocks: int
    """Distinct hashes some worker holds on its device."""
    block_replicas: int
    """Device blocks summed over the workers."""
    models: list[tuple[ModelSpec, int]] = field(default_factory=list)
    host_indexed_blocks: int = 0
    """Distinct hashes some worker holds in its host tier."""
    host_block_replicas: int = 0
    """Host-tier blocks summed over the workers."""


class BlockIndex(abc.ABC):
    """Where the index lives. Raises kvmesh.contract.errors types; never returns partial updates."""

    name: str
    pending_config: PendingConfig = PendingConfig()
    """Set by the KVService that owns the store."""

    @abc.abstractmethod
    async def register_worker(self, reg: Registration, lease_ttl_ms: int, now_ms: int) -> None:
        """(Re)joins a worker: new epoch, last_seq 0, its previous blocks dropped.

        Raises:
            FailedPrecondition: block size / algorithm disagree with the model's live workers, the
                worker id is live under another model, or the epoch is older than the live one.
        """

    @abc.abstractmethod
    async def heartbeat(self, worker_id: str, epoch: int, load: Load, lease_ttl_ms: int, now_ms: int) -> bool:
        """Renews the lease and records the load (which retires the pending picks it covers);
        returns True while the worker owes a snapshot since ``flush_worker``.
        Raises NotFound (unknown or expired) or FailedPrecondition (epoch)."""

    @abc.abstractmethod
    async def publish(
        self, worker_id: str, epoch: int, seq: int, events: list[KVCacheEvent], now_ms: int, load: Load | None = None
    ) -> PublishResult:
        """Applies one batch if ``seq`` is the next one of the live epoch (and the worker owes no
        snapshot since ``flush_worker``), else asks for a resync. An applied batch with a ``load``
        also records it as the worker's load (the lease stays the heartbeat's to renew).

        Raises:
            NotFound: unknown or expired worker.
            FailedPrecondition: an older epoch, or ``seq`` not above the last applied one.
        """

    @abc.abstractmethod
    async def snapshot(self, worker_id: str, epoch: int, seq: int, hashes: list[bytes], now_ms: int,
                       load: Load | None = None, host_hashes: Sequence[bytes] = ()) -> PublishResult:
        """Replaces the worker's device blocks with ``hashes`` and its host-tier blocks with
        ``host_hashes`` (each oldest first) and adopts (epoch, seq); settles a resync
        ``flush_worker`` asked for; records ``load`` as ``publish`` does."""

    @abc.abstractmethod
    async def lookup(self, model_id: str, hashes: list[bytes], now_ms: int) -> list[WorkerMatch]:
        """Per live worker of the model, the leading blocks of ``hashes`` it holds on its device
        (``matched_blocks``) and how far its host tier continues them (``host_blocks``)."""

    @abc.abstractmethod
    async def reserve(self, reservation: Reservation, now_ms: int) -> ReservationAnswer:
        """Records a router's reservation of a live worker of ``reservation.model_id``, unless ``seen_version`` is
        set and another router reserved the worker after it (then nothing changes and the answer
        lists the model's live workers' pending picks).

        ``release_worker_id``: this request's pick on that worker is dropped first (its previous
        reservation, which a folded Lookup made).

        Raises:
            NotFound: the worker is not live, or serves another model.
        """

    @abc.abstractmethod
    async def holders(self, block_hash: bytes, now_ms: int, tier: Tier = Tier.DEVICE) -> list[str]:
        """Live workers holding one block in ``tier``, sorted."""

    @abc.abstractmethod
    async def workers(self, now_ms: int, include_expired: bool = False) -> list[WorkerInfo]:
        """Registered workers, sorted by id."""

    @abc.abstractmethod
    async def stats(self, now_ms: int) -> IndexStats: ...

    @abc.abstractmethod
    async def model_spec(self, model_id: str) -> ModelSpec | None: ...

    @abc.abstractmethod
    async def flush_worker(self, worker_id: str) -> int:
        """Drops every block of the worker (both tiers) and marks it as owing a snapshot: its
        heartbeats answer ``True`` and its event batches RESYNC until one arrives, so index and
        worker agree again within a heartbeat. Returns how many (block, tier) entries were dropped.
        Raises NotFound."""

    @abc.abstractmethod
    async def reap_expired(self, now_ms: int) -> int:
        """Deletes workers whose lease expired (and their blocks); returns how many workers."""

    def writer(self) -> BlockIndex | None:
        """The same index through connections of its own, for event batches applied on another event loop
        (docs/kv-service.md "Reads apart from ingest"); None: this store applies them where it serves reads
        (a store without I/O: nothing to wait for)."""
        return None

    async def ping(self) -> None:  # noqa: B027 - optional hook
        """Raises kvmesh.contract.errors.Unavailable when the store cannot be reached."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Releases connections."""
