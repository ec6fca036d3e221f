"""The store factory: one place that picks the index's store from the kv_service's settings.

As llm-d's ``kvblock.NewIndex``: the command (`kvmesh kv-service`) and the simulator both call
:func:`make_store`; a store is a :class:`~kvmesh.kv_service.index.BlockIndex` either way. A store's
module is imported when it is asked for, by name: the simulator (one process, no redis, no grpc:
pyproject's import contracts, tests/sim/test_one_code_path.py) asks for the memory store and never
loads redis.
"""

from __future__ import annotations

import importlib

from kvmesh.kv_service.config import DEFAULT_REDIS_URL, RedisStoreConfig
from kvmesh.kv_service.index import BlockIndex

STORES = {"memory": "kvmesh.kv_service.store_memory", "redis": "kvmesh.kv_service.store_redis"}
"""Each store's module; it defines the store's class (MemoryIndex, RedisIndex)."""


def make_store(store: str | None = None, redis_url: str | None = None,
               redis: RedisStoreConfig | None = None, lookup_walk: str = "search") -> BlockIndex:
    """``store``: "memory" (in this process), or "redis" / None (at ``redis_url``, default
    redis://127.0.0.1:6379/0, with ``redis``'s settings); ``lookup_walk``: how a Lookup finds each
    worker's prefix (docs/kv-service.md, "Lookup"). Raises ValueError for another name."""
    name = store or "redis"
    if name not in STORES:
        raise ValueError(f"store must be redis or memory, got {store!r}")
    module = importlib.import_module(STORES[name])
    if name == "memory":
        return module.MemoryIndex(lookup_walk=lookup_walk)
    r = redis or RedisStoreConfig()
    return module.RedisIndex(redis_url or DEFAULT_REDIS_URL, namespace=r.namespace,
                             max_blocks_per_call=r.max_blocks_per_call, max_connections=r.redis_connections,
                             shards=r.shards, read_replicas=r.read_replicas, lookup_walk=lookup_walk,
                             ingest_loop=r.ingest_loop)
