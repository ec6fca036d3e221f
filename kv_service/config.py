"""The kv_service's one config type (flags of `kvmesh kv-service`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.contract.settings import code_only, flag

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
MAX_SHARDS = 256
"""--shards at most (kvmesh.kv_service.store_redis.MAX_SHARDS: every Lookup is one script call per shard)."""
LOOKUP_WALKS = ("search", "linear")
"""How a Lookup finds each worker's match (kv_service/prefix_search.py): search, or the walk it replaced."""
INGEST_LOOPS = ("apart", "shared")
"""Where event batches are applied: on an event loop and Redis connections of their own, or on the serving loop."""


@dataclass(slots=True, frozen=True)
class PendingConfig:
    """How long a router's pick counts in the shared router view (docs/router.md, "Several routers")."""

    grace_ms: int = flag(100, name="pending-grace-ms")
    """From a worker that lists no admissions (a bridged vLLM / SGLang), a report covers the picks taken this long
    before it arrived: the pick's forwarding, the engine's admission and its next load report."""
    ttl_ms: int = flag(5_000, name="pending-ttl-ms")
    """A pick no report covered counts at most this long (a request that never reached its worker: its router died
    between the pick and the forward; a lost report)."""
    max_per_worker: int = flag(65_536, name="pending-max-per-worker")
    """Picks kept per worker; past it the oldest go (a router that never forwards cannot grow the store)."""
    prefix_ttl_ms: int = flag(2_000, name="pending-prefix-ttl-ms")
    """A reserved pick's prompt counts as held by its worker this long in every router's Lookup (the routers'
    --speculative-ttl, shared; by then the worker's own events say what it holds); 0 = off."""

    def check(self) -> None:
        if self.grace_ms < 0 or self.ttl_ms < 1 or self.max_per_worker < 1 or self.prefix_ttl_ms < 0:
            raise ValueError("--pending-grace-ms and --pending-prefix-ttl-ms must be >= 0, --pending-ttl-ms and "
                             "--pending-max-per-worker >= 1")


@dataclass(slots=True)
class ServiceConfig:
    """The kv_service core's settings (the simulator's index uses them too)."""

    lease_ttl_ms: int = 10_000
    """Worker lease: a worker without a heartbeat for this long leaves lookups."""
    pending: PendingConfig = field(default_factory=PendingConfig)
    """The routers' picks (a group: its fields are the flags)."""
    watch_interval_ms: int = 100
    """While a router or endpoint picker watches the worker set (WatchWorkers), how often this replica reads it:
    a change made through another replica, or a lease that ended, reaches the watchers this late at most (one made
    here, at once)."""
    reap_interval_s: float | None = code_only(None)
    """How often expired workers and their blocks are deleted from the store; none = twice per lease."""

    @property
    def reap_every_s(self) -> float:
        return self.reap_interval_s if self.reap_interval_s is not None else max(0.1, self.lease_ttl_ms / 2000)

    def check(self) -> None:
        if self.lease_ttl_ms < 100:
            raise ValueError(f"--lease-ttl-ms must be >= 100, got {self.lease_ttl_ms}")
        if not 10 <= self.watch_interval_ms <= 60_000:
            raise ValueError(f"--watch-interval-ms must be in [10, 60000], got {self.watch_interval_ms}")
        self.pending.check()


@dataclass(slots=True)
class RedisStoreConfig:
    """The Redis store's settings (kv_service/store_redis.py)."""

    namespace: str = "kvmesh"
    """Redis key hash tag; deployments sharing one Redis use different ones."""
    max_blocks_per_call: int = 256
    """Block hashes one Redis event-apply script carries at most; a bigger batch is applied in several calls, so
    a Lookup never waits behind a whole batch."""
    redis_connections: int = 64
    """Connections to each Redis node at most (the script calls' own pool; a call waits for a free one); with
    --ingest-loop apart, event batches have a pool of their own of the same bound."""
    shards: int = 1
    """Redis Cluster hash tags one index is spread over: a worker's blocks and events live on its home shard, a
    Lookup asks every shard in one parallel round. Set it to the cluster's masters (or a multiple); 1 = one node
    holds the whole namespace. Every replica of a namespace uses the same value."""
    read_replicas: bool = False
    """Send Lookups to the Redis replicas of each shard, spread over them (EVALSHA_RO, Redis >= 7); a shard with no
    replica in sync is read on its master. Writes, Reserve and admin reads stay on the masters. A Lookup then sees
    the index up to the replication lag late (docs/kv-service.md "Lookups from replicas")."""
    ingest_loop: str = "shared"
    """Where event batches (PublishEvents, snapshots) and the lease reaper run: shared, on the loop that serves
    every call; apart, on an event loop thread and Redis connections of their own, so a Lookup or Reserve never
    queues behind a batch's callbacks (the two threads still take turns on the GIL; docs/kv-service.md "Reads
    apart from ingest" says why it is not the default)."""

    def check(self) -> None:
        if self.max_blocks_per_call < 1 or self.redis_connections < 1:
            raise ValueError("--max-blocks-per-call and --redis-connections must be >= 1")
        if self.ingest_loop not in INGEST_LOOPS:
            raise ValueError(f"--ingest-loop must be one of {', '.join(INGEST_LOOPS)}, got {self.ingest_loop!r}")
        if not 1 <= self.shards <= MAX_SHARDS:
            raise ValueError(f"--shards must be in [1, {MAX_SHARDS}], got {self.shards}")


@dataclass(slots=True, frozen=True)
class FaultConfig:
    """Faults this replica injects into its own answers: a stress setting for tests and benchmarks
    (docs/kv-service.md, "Injected latency"), never for production."""

    lookup_delay_ms: float = 0.0
    """Every Lookup is answered this much later: half before the index reads, half after (a slow round trip)."""
    reserve_delay_ms: float = 0.0
    """Every Reserve is answered this much later: half before the pick lands, half after."""

    def check(self) -> None:
        if not (0 <= self.lookup_delay_ms <= 60_000 and 0 <= self.reserve_delay_ms <= 60_000):
            raise ValueError("--lookup-delay-ms and --reserve-delay-ms must be in [0, 60000]")


@dataclass(slots=True)
class KVServiceConfig:
    host: str = "0.0.0.0"
    """Listen address."""
    port: int = 50052
    """gRPC port; 0 picks a free one (tests)."""
    redis_url: str | None = flag(None, metavar="URL")
    """The Redis that keeps the index (the default store); none = redis://127.0.0.1:6379/0."""
    store: str | None = None
    """'memory' keeps the index in this process (a single replica only); none = Redis."""
    redis: RedisStoreConfig = field(default_factory=RedisStoreConfig)
    """The Redis store (a group: its fields are the flags)."""
    service: ServiceConfig = field(default_factory=ServiceConfig)
    """Leases and the routers' picks (a group: its fields are the flags)."""
    max_publishers: int = 1024
    """Workers that may stream block events to this replica at once; one more is refused with RESOURCE_EXHAUSTED."""
    lookup_walk: str = "search"
    """How a Lookup finds each worker's match: search (a binary search per worker, O(log n) probes of the chain;
    exact while every worker's blocks are prefix-closed, docs/kv-service.md "Lookup") or linear (the walk down the
    chain to the first miss that it replaced; a baseline for benchmarks)."""
    faults: FaultConfig = field(default_factory=FaultConfig)
    """Injected latency (a group: its fields are the flags)."""

    def check(self) -> None:
        """Raises ValueError with the flag to fix."""
        if self.store not in (None, "redis", "memory"):
            raise ValueError(f"--store must be redis or memory, got {self.store!r}")
        if self.store == "memory" and self.redis_url:
            raise ValueError("--redis-url and --store memory exclude each other")
        if self.max_publishers < 1:
            raise ValueError(f"--max-publishers must be >= 1, got {self.max_publishers}")
        self.service.check()
        self.redis.check()
        self.faults.check()
        if self.store == "memory" and self.redis.shards != 1:
            raise ValueError("--shards applies to the Redis store, not --store memory")
        if self.store == "memory" and self.redis.read_replicas:
            raise ValueError("--read-replicas applies to the Redis store, not --store memory")
        if self.lookup_walk not in LOOKUP_WALKS:
            raise ValueError(f"--lookup-walk must be one of {', '.join(LOOKUP_WALKS)}, got {self.lookup_walk!r}")
