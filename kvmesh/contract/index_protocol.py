"""The index protocol's records: one type per concept, used by every side.

The kv_service (its stores and core), the router (its core and its kv_service client), the
workers' publisher and the simulator all speak in these; kvmesh/contract/convert.py is the one
place they become kvmesh.v1 messages and back. Before, each side had its own name for the same
thing (a reservation was the router's ``Claim``, the wire's ``ReserveRequest`` and the store's
``Pick``); docs/architecture.md, "One vocabulary", lists the names.

| concept | record | on the wire (kv_service.proto) |
|---|---|---|
| routers' picks of a worker its reports do not cover yet | :class:`Pending` | PendingPicks |
| a worker joining the index | :class:`Registration` | RegisterWorkerRequest |
| what the index knows of a worker | :class:`WorkerInfo` | WorkerInfo |
| one worker's answer to a Lookup | :class:`WorkerMatch` | WorkerMatch |
| a router's pick reserved before forwarding | :class:`Reservation` | ReserveRequest |
| the index's answer to it | :class:`ReservationAnswer` | ReserveResponse |
| a worker's miss audit (router reports, admin reads) | :class:`WorkerAudit` | WorkerAudit |

No grpc, no redis.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from kvmesh.contract.types import Load


@dataclass(slots=True, frozen=True)
class Pending:
    """Routers' picks of one worker that its reports do not cover yet: the shared router view.

    A router reserves each pick in the kv_service before it forwards the request; every router's
    next Lookup sees it here until the worker's own report covers it (docs/router.md, "Several
    routers"). ``version`` counts the worker's reservations: a router reserves on the condition
    that no other router reserved the worker since its Lookup.
    """

    requests: int = 0
    prefill_tokens: int = 0
    """Uncached prompt tokens of those requests."""
    blocks: int = 0
    """KV blocks their prompts take."""
    version: int = 0


NO_PENDING = Pending()


@dataclass(slots=True, frozen=True)
class Registration:
    """A worker joining the index (a new process, or a new epoch of one)."""

    worker_id: str
    address: str
    model_id: str
    block_size: int
    hash_algorithm: str
    num_blocks: int
    epoch: int
    engine: str = "kvmesh"
    """What serves the worker's requests: kvmesh, vllm or sglang (a bridge registers those)."""
    host_blocks: int = 0
    """Blocks of its host KV tier (docs/engine.md, Host KV tier): the index's cap on what it keeps of
    that tier for the worker, as ``num_blocks`` caps the device's. 0 = not declared (no tier, or an
    engine behind a bridge whose tier kvmesh cannot size): the index caps it at
    ``UNDECLARED_HOST_FACTOR`` x ``num_blocks``."""
    role: str = "both"
    """What it serves: prefill, decode or both (kvmesh/contract/kv_transfer.py, docs/architecture.md)."""

    @property
    def host_cap(self) -> int:
        """The most host-tier blocks the index keeps for the worker."""
        return self.host_blocks or UNDECLARED_HOST_FACTOR * self.num_blocks


UNDECLARED_HOST_FACTOR = 8
"""A worker that declares no host tier but reports host-tier blocks (a bridged vLLM with CPU
offloading) has them capped at this many times its device blocks: the cap only bounds the index when
removal events were lost, and vLLM's CPU tier is sized in GiB the bridge cannot read."""


@dataclass(slots=True)
class WorkerInfo:
    """What the index knows of one registered worker (ListWorkers, admin, the routers' discovery)."""

    registration: Registration
    last_seq: int
    blocks_indexed: int
    """Blocks the index holds for the worker on its device tier."""
    load: Load
    lease_expiry_ms: int
    """When the lease ends, on the clock of whoever holds the record (the index's; a client's
    copy is its receipt time plus the lease remaining on the wire)."""
    pending: Pending = NO_PENDING
    host_blocks_indexed: int = 0
    """Blocks the index holds for the worker in its host tier."""

    def live(self, now_ms: int) -> bool:
        return self.lease_expiry_ms > now_ms


class WorkerMatch(NamedTuple):
    """One live worker's answer to a Lookup (a NamedTuple: built once per worker per Lookup)."""

    worker_id: str
    address: str
    matched_blocks: int
    """Leading blocks of the asked chain the worker holds on its device (docs/kv-service.md, "Lookup")."""
    load: Load
    block_size: int = 0
    pending: Pending = NO_PENDING
    """Routers' picks of the worker its reports do not cover yet (the shared router view)."""
    pending_blocks: int = 0
    """Leading blocks of the asked chain that a pick reserved on the worker will hold once prefilled
    (the routers' speculative maps, shared: kv_service/pending_prefixes.py)."""
    host_blocks: int = 0
    """How far the worker's host tier continues the device prefix: the longest prefix it holds in
    device or host memory, less ``matched_blocks`` (blocks it would load back, not recompute)."""


@dataclass(slots=True, frozen=True)
class Reservation:
    """A router's pick of a worker for one request, reserved in the kv_service before the request is
    forwarded (the shared router view, docs/router.md "Several routers")."""

    model_id: str
    worker_id: str
    router_id: str
    request_id: str
    """The id the worker sees the request under: its admission retires the reservation."""
    prefill_tokens: int
    """Uncached prompt tokens the request brings to the worker."""
    blocks: int
    """KV blocks its prompt takes."""
    seen_version: int | None = None
    """The worker's ``Pending.version`` in the router's Lookup: refused when another router
    reserved the worker since; None = unconditional."""
    anchors: tuple[bytes, ...] = ()
    """Hashes of the prompt's blocks 1, 2, 4, 8, ... and its last: the prefixes the worker will hold
    (kv_service/pending_prefixes.py); every router's next Lookup sees them."""
    release_worker_id: str = ""
    """A worker this request was reserved on before (a Lookup's folded reservation the pick moved away
    from): its pick there is dropped first. "" = none."""


@dataclass(slots=True, frozen=True)
class ReservationAnswer:
    reserved: bool
    pending: dict[str, Pending] = field(default_factory=dict)
    """When refused: every live worker of the model and its pending picks now, by worker id."""
    anchored: dict[str, int] = field(default_factory=dict)
    """When refused: per worker, how many of the reservation's leading anchors a pick reserved there
    holds (the prefix of this prompt that worker will hold: anchor ``n - 1``'s position + 1); 0s omitted."""


@dataclass(slots=True)
class WorkerAudit:
    """One worker's miss audit (docs/router.md, "Miss audit"): requests routed to it with a Lookup
    answer, the blocks the index predicted they would find cached there, and the engine's count."""

    requests: int = 0
    predicted_blocks: int = 0
    cached_blocks: int = 0
    predicted_hits: int = 0
    """Requests with a predicted hit (at least one block)."""
    cached_hits: int = 0
    """Requests the engine served at least one cached block to."""
    silent_misses: int = 0
    """Requests predicted at least one block more than the engine used."""
    unseen_hits: int = 0
    """Requests predicted at least one block less than the engine used."""
    engine: str = ""
    """kvmesh, vllm or sglang (filled by the kv_service from the worker's registration)."""

    def add(self, other: WorkerAudit) -> None:
        self.requests += other.requests
        self.predicted_blocks += other.predicted_blocks
        self.cached_blocks += other.cached_blocks
        self.predicted_hits += other.predicted_hits
        self.cached_hits += other.cached_hits
        self.silent_misses += other.silent_misses
        self.unseen_hits += other.unseen_hits

    def observe(self, predicted: int, cached: int) -> None:
        """One request: ``predicted`` blocks expected cached, ``cached`` used by the engine."""
        self.requests += 1
        self.predicted_blocks += predicted
        self.cached_blocks += cached
        self.predicted_hits += predicted > 0
        self.cached_hits += cached > 0
        self.silent_misses += predicted >= cached + 1
        self.unseen_hits += cached >= predicted + 1


def anchor_positions(n: int) -> list[int]:
    """The 0-based indices of a chain of ``n`` blocks that a Reserve anchors: 2**k - 1, and n - 1.

    NOTE: block hashes are chained, so two chains equal at index i share their first i + 1 blocks:
    a Lookup reads its own chain at these positions only (O(log n)), and finds the longest shared
    power-of-two prefix (or the whole prompt) of every reserved prompt."""
    out, p = [], 1
    while p <= n:
        out.append(p - 1)
        p <<= 1
    if n and out[-1] != n - 1:
        out.append(n - 1)
    return out


def anchors_of(chain: Sequence[bytes]) -> tuple[bytes, ...]:
    """The anchors a Reserve carries for a prompt's chain (:func:`anchor_positions`)."""
    return tuple(chain[i] for i in anchor_positions(len(chain)))


class IndexUnavailable(Exception):
    """The prefix index (kv_service) could not answer a Lookup or Reserve; route without it."""

    def __init__(self, message: str, cause: str = "lookup_failed", code: int | None = None) -> None:
        super().__init__(message)
        self.cause = cause
        """lookup_failed (the index is down or too slow: the router's breaker opens), lookup_invalid
        (it refused this Lookup as malformed: this request routes without it, the index stays in
        use), reserve_failed, or index_down (skipped: a recent call failed)."""
        self.code = code
        """The failed call's gRPC status code number (its span's ``rpc.grpc.status_code``); None: no call."""
