"""The kv_service's one config type (flags of `kvmesh kv-service`)."""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.contract.settings import flag

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
MAX_SHARDS = 256
"""--shards at most (kvmesh.kv_service.store_redis.MAX_SHARDS: every Lookup is one script call per shard)."""


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
    namespace: str = "kvmesh"
    """Redis key hash tag; deployments sharing one Redis use different ones."""
    lease_ttl_ms: int = 10_000
    """Worker lease: a worker without a heartbeat for this long leaves lookups."""
    max_publishers: int = 1024
    """Workers that may stream block events to this replica at once; one more is refused with RESOURCE_EXHAUSTED."""
    max_blocks_per_call: int = 256
    """Block hashes one Redis event-apply script carries at most; a bigger batch is applied in several calls, so
    a Lookup never waits behind a whole batch."""
    redis_connections: int = 64
    """Connections to each Redis node at most (the script calls' own pool; a call waits for a free one)."""
    shards: int = 1
    """Redis Cluster hash tags one index is spread over: a worker's blocks and events live on its home shard, a
    Lookup asks every shard in one parallel round. Set it to the cluster's masters (or a multiple); 1 = one node
    holds the whole namespace. Every replica of a namespace uses the same value."""

    def check(self) -> None:
        """Raises ValueError with the flag to fix."""
        if self.store not in (None, "redis", "memory"):
            raise ValueError(f"--store must be redis or memory, got {self.store!r}")
        if self.store == "memory" and self.redis_url:
            raise ValueError("--redis-url and --store memory exclude each other")
        if self.lease_ttl_ms < 100:
            raise ValueError(f"--lease-ttl-ms must be >= 100, got {self.lease_ttl_ms}")
        if self.max_publishers < 1:
            raise ValueError(f"--max-publishers must be >= 1, got {self.max_publishers}")
        if self.max_blocks_per_call < 1 or self.redis_connections < 1:
            raise ValueError("--max-blocks-per-call and --redis-connections must be >= 1")
        if not 1 <= self.shards <= MAX_SHARDS:
            raise ValueError(f"--shards must be in [1, {MAX_SHARDS}], got {self.shards}")
        if self.store == "memory" and self.shards != 1:
            raise ValueError("--shards applies to the Redis store, not --store memory")

    @property
    def reap_interval_s(self) -> float:
        """Expired workers are deleted twice per lease."""
        return max(0.1, self.lease_ttl_ms / 2000)
