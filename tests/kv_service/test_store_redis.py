"""The Redis store's own machinery (not index semantics: those are test_index_conformance.py)."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.contract.index_protocol import Registration
from kvmesh.contract.types import Load
from kvmesh.kv_service.store_redis import RedisIndex

pytestmark = pytest.mark.anyio


async def test_a_lookup_answers_the_latest_reported_load_and_reuses_unchanged_ones(redis_url, redis_namespace):
    """The load Lookup answers is the one the last report stored (no cache that lags a report: the
    shared router view retires a worker's picks on that report), parsed once while it is unchanged."""
    idx = RedisIndex(redis_url, redis_namespace, shards=3)
    try:
        await idx.register_worker(Registration("w1", "127.0.0.1:1", "m", 4, "sha256_128", 100, 1), 10_000, 0)
        first = (await idx.lookup("m", [b"h" * 16], 1))[0].load
        assert first == Load() and (await idx.lookup("m", [b"h" * 16], 2))[0].load is first
        await idx.heartbeat("w1", 1, Load(num_waiting=3, queued_prefill_tokens=99), 10_000, 3)
        assert (await idx.lookup("m", [b"h" * 16], 4))[0].load.num_waiting == 3
        await idx.publish("w1", 1, 1, [], 5, Load(num_waiting=1))
        assert (await idx.lookup("m", [b"h" * 16], 6))[0].load.num_waiting == 1
    finally:
        await asyncio.wait_for(idx.close(), 5)


@pytest.mark.parametrize("shards", [1, 3])
async def test_the_holders_hash_is_a_hash_table_from_the_first_registration(redis_url, redis_namespace, shards):
    """A fresh index is small, and Redis keeps a small hash as a listpack that every probe scans field by
    field (a Lookup's ~8 HMGETs over 250 blocks: 9 us instead of 1). One field that is no block hash keeps
    ``bh`` a hash table; it is not a block in the stats."""
    import redis as redis_lib

    from kvmesh.contract.types import AllBlocksCleared, BlockStored

    idx = RedisIndex(redis_url, redis_namespace, shards=shards)
    r = redis_lib.Redis.from_url(redis_url)
    try:
        await idx.register_worker(Registration("w1", "127.0.0.1:1", "m", 16, "sha256_128", 100, 1), 10_000, 0)
        await idx.publish("w1", 1, 1, [BlockStored([bytes([i]) * 16 for i in range(10)])], 1, None)
        home = idx.prefixes[idx.home("w1")]
        assert r.object("encoding", f"{home}bh") == b"hashtable"
        assert (await idx.stats(2)).indexed_blocks == 10
        await idx.publish("w1", 1, 2, [AllBlocksCleared()], 3, None)
        assert (await idx.stats(4)).indexed_blocks == 0 and r.object("encoding", f"{home}bh") == b"hashtable"
    finally:
        r.close()
        await asyncio.wait_for(idx.close(), 5)
