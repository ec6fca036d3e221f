"""Index scenarios on a real Redis (tests/kv_service/: the sharded store and its replicas): chains,
registrations, one worker id per shard, a Lookup as a dict, and polling a cluster that is changing."""

from __future__ import annotations

import asyncio
import time

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.index_protocol import Registration
from kvmesh.kv_service.redis_cluster import home_shard
from kvmesh.kv_service.store_redis import RedisIndex

TTL = 60_000
T0 = 1_000_000


def chain(n: int, start: int = 0) -> list[bytes]:
    return BlockHasher("m", 4).hash_prompt(list(range(start, start + 4 * n)))


def reg(wid: str, *, bs: int = 4, model: str = "m", epoch: int = 1) -> Registration:
    return Registration(wid, "127.0.0.1:50061", model, bs, "sha256_128", 1000, epoch)


def one_id_per_shard(shards: int, prefix: str = "worker-") -> list[str]:
    """Worker ids, the k-th of which lives on shard k."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < shards:
        found.setdefault(home_shard(f"{prefix}{i}", shards), f"{prefix}{i}")
        i += 1
    return [found[k] for k in range(shards)]


async def matches(index: RedisIndex, hashes: list[bytes], now: int = T0) -> dict[str, int]:
    return {m.worker_id: m.matched_blocks for m in await index.lookup("m", hashes, now)}


async def wait_for(probe, timeout: float, what: str):
    """Polls ``probe`` (a function, or a coroutine function) until it returns a true value
    (exceptions count as not yet); returns that value."""
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            got = probe()
            if asyncio.iscoroutine(got):
                got = await got
            if got:
                return got
        except Exception as exc:  # noqa: BLE001 - the cluster is still changing
            last = exc
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what} (last error: {last!r})")
