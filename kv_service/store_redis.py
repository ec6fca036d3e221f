"""The Redis-backed index: every multi-key update is one Lua script (atomic), one round trip.

Key layout (all under the prefix ``kvm:{<namespace>}:``; the hash tag keeps the index in one
Redis Cluster slot so scripts stay atomic there):

    bh            HASH  block hash -> ",n1,n2," the holders' worker numbers (refcount = live
                        holders; the field is deleted at 0, so HLEN = distinct blocks)
    wn / nw       HASH  worker id <-> its number (new at every registration)
    wseq          INT   the last worker number given out
    l:<worker>    ZSET  the worker's blocks, score = access counter (LRU order)
    w:<worker>    HASH  model, addr, bs, algo, nb, epoch, seq, ctr, load, lease, num
    m:<model>     HASH  bs, algo (the model's registered spec)
    mw:<model>    ZSET  worker -> lease expiry (ms)
    ld:<model>    HASH  worker -> "addr|block_size|load" (cached in-process for Lookup)
    workers       ZSET  worker -> lease expiry (ms), every model
    models        SET   model ids
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import redis
import redis.asyncio as aioredis

from kvmesh.contract.block_hash import HASH_LEN
from kvmesh.contract.errors import FailedPrecondition, NotFound, Unavailable
from kvmesh.contract.types import AllBlocksCleared, BlockStored, KVCacheEvent, Load, ModelSpec
from kvmesh.kv_service.index import (
    Action,
    BlockIndex,
    IndexStats,
    PublishResult,
    Registration,
    WorkerInfo,
    WorkerMatch,
)

_LUA_DIR = Path(__file__).parent / "lua"

DEFAULT_MAX_BLOCKS_PER_CALL = 256
"""Block hashes one event-apply script call carries at most (``--max-blocks-per-call``)."""
DEFAULT_MAX_CONNECTIONS = 64
"""Redis connections of one kv_service replica (``--redis-connections``)."""


def _script_source(name: str) -> str:
    return (_LUA_DIR / "common.lua").read_text() + "\n" + (_LUA_DIR / f"{name}.lua").read_text()


def _s(raw: bytes | str | None) -> str:
    return raw.decode() if isinstance(raw, bytes) else (raw or "")


def split_payload(events: list[KVCacheEvent], limit: int) -> list[list]:
    """The publish script's payload ('S' hashes | 'R' hashes | 'C'; the hashes of one event as one
    concatenated string) in parts of at most ``limit`` hashes each, in event order; a long event
    is cut across parts."""
    parts: list[list] = []
    cur: list = []
    size = 0
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            cur.append("C")
            continue
        op = "S" if isinstance(ev, BlockStored) else "R"
        hashes = ev.block_hashes
        i = 0
        while i < len(hashes):
            if size >= limit:
                parts.append(cur)
                cur, size = [], 0
            chunk = hashes[i:i + limit - size]
            cur += [op, b"".join(chunk)]
            size += len(chunk)
            i += len(chunk)
    parts.append(cur)
    return parts


class ScriptConnections:
    """The index's scripts (and PING) on connections of our own: at most ``size`` calls at once,
    each on an idle connection (LIFO), one command and one reply per call.

    NOTE: every Lookup and event batch is one script call, so this path is the kv_service's
    Redis latency. redis-py's pools add ~30-60 us a call here (a lock or condition, retry and
    observability hooks); a plain Connection's send_command/read_response is the round trip
    and nothing else. Everything else (admin reads, pipelines) uses redis-py's client.
    """

    def __init__(self, pool: aioredis.ConnectionPool, size: int) -> None:
        self._pool = pool
        self._size = size
        self._free: list[aioredis.Connection] = []
        self._slots: asyncio.Semaphore | None = None
        self._shas: dict[str, str] = {}

    async def command(self, *args: Any) -> Any:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._size)
        async with self._slots:
            conn = self._free.pop() if self._free else self._pool.make_connection()
            try:
                await conn.send_command(*args)
                reply = await conn.read_response()
            except redis.ResponseError:
                self._free.append(conn)  # an error reply: the connection is in step
                raise
            except BaseException:
                # NOTE: timed out, broken or cancelled mid-reply: never reuse a connection whose
                # reply may still arrive (the next call would read it).
                with contextlib.suppress(Exception):
                    await conn.disconnect()
                raise
            self._free.append(conn)
            return reply

    async def script(self, source: str, keys: list[str], args: list[Any]) -> Any:
        sha = self._shas.get(source)
        if sha is None:
            sha = self._shas[source] = hashlib.sha1(source.encode()).hexdigest()
        try:
            return await self.command("EVALSHA", sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:  # a Redis that restarted (or another node) lost it
            await self.command("SCRIPT", "LOAD", source)
            return await self.command("EVALSHA", sha, len(keys), *keys, *args)

    async def close(self) -> None:
        free, self._free = self._free, []
        for conn in free:
            with contextlib.suppress(Exception):
                await conn.disconnect()


class RedisIndex(BlockIndex):
    """Args:
    url: ``redis://[:password@]host:port/db`` (``rediss://`` for TLS).
    namespace: hash tag of the keys; deployments sharing a Redis use different ones.
    max_blocks_per_call: hashes per event-apply script call. Redis runs one script at a time and
        nothing else meanwhile, so a Lookup arriving during a 20 ms batch of thousands of blocks
        would wait for all of it; in parts of this size it waits for at most one part.
    max_connections: the connection pool's size; a call waits for a free connection.

    The client (redis.asyncio) binds its connections to the event loop that first uses them: use
    one RedisIndex from one loop.
    """

    name = "redis"

    def __init__(self, url: str, namespace: str = "kvmesh", socket_timeout: float = 2.0,
                 max_blocks_per_call: int = DEFAULT_MAX_BLOCKS_PER_CALL,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", namespace):
            raise ValueError(f"namespace must be 1-64 letters, digits, '_', '.', '-', got {namespace!r}")
        if max_blocks_per_call < 1 or max_connections < 1:
            raise ValueError("max_blocks_per_call and max_connections must be >= 1")
        self.url = url
        self.max_blocks_per_call = max_blocks_per_call
        pool = aioredis.BlockingConnectionPool.from_url(
            url, max_connections=max_connections, timeout=socket_timeout, socket_timeout=socket_timeout,
            socket_connect_timeout=socket_timeout)
        self._r = aioredis.Redis(connection_pool=pool)
        self._fast = ScriptConnections(pool, max_connections)
        self.prefix = f"kvm:{{{namespace}}}:"
        self._key = self.prefix + "workers"  # the KEYS[1] that routes every script to the slot
        self._info: dict[str, dict[bytes, tuple[str, str, int, Load]]] = {}
        self._refresher: asyncio.Task | None = None
        self._scripts = {n: _script_source(n) for n in ("register", "heartbeat", "publish", "lookup", "admin")}

    async def _call(self, script: str, *args: Any) -> Any:
        return await self._redis(self._fast.script(self._scripts[script], [self._key], [self.prefix, *args]))

    async def _redis(self, call: Awaitable[Any]) -> Any:
        try:
            return await call
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise Unavailable(f"the index's Redis is unreachable: {exc}") from None

    async def ping(self) -> None:
        """One PING round trip on the path every script call takes."""
        await self._redis(self._fast.command("PING"))

    @staticmethod
    def _not_found(worker_id: str) -> NotFound:
        return NotFound(f"worker {worker_id!r} is not registered or its lease expired; register it again")

    async def register_worker(self, reg: Registration, lease_ttl_ms: int, now_ms: int) -> None:
        res = await self._call(
            "register", reg.worker_id, reg.address, reg.model_id, reg.block_size, reg.hash_algorithm,
            reg.num_blocks, reg.epoch, now_ms, lease_ttl_ms,
        )
        code = _s(res[0])
        if code == "SPEC":
            raise FailedPrecondition(
                f"model {reg.model_id!r} is served with block_size={_s(res[1])}, hash={_s(res[2])}; worker "
                f"{reg.worker_id!r} registered block_size={reg.block_size}, hash={reg.hash_algorithm}: "
                "start it with the same settings"
            )
        if code == "MODEL":
            raise FailedPrecondition(
                f"worker id {reg.worker_id!r} is live for model {_s(res[1])!r}; "
                f"give the worker serving {reg.model_id!r} another --worker-id"
            )
        if code == "EPOCH":
            raise FailedPrecondition(
                f"stale registration of {reg.worker_id!r}: epoch {reg.epoch} < live epoch {_s(res[1])}"
            )

    async def heartbeat(self, worker_id: str, epoch: int, load: Load, lease_ttl_ms: int, now_ms: int) -> bool:
        res = await self._call("heartbeat", worker_id, epoch, load.encode(), now_ms, lease_ttl_ms)
        code = _s(res[0])
        if code == "NOT_FOUND":
            raise self._not_found(worker_id)
        if code == "EPOCH":
            raise FailedPrecondition(
                f"heartbeat for epoch {epoch} but worker {worker_id!r} is registered with epoch {_s(res[1])}"
            )
        return len(res) > 1 and _s(res[1]) != "0"

    async def _publish(self, worker_id: str, epoch: int, seq: int, now_ms: int, snapshot: bool,
                       parts: list[list], load: Load | None) -> PublishResult:
        # NOTE: part 0 checks the order (and a snapshot clears the worker); each later part checks
        # the worker's pending (seq, part) and the last commits seq. Lookups and other workers'
        # batches run between parts: the index then holds a prefix of this batch's events.
        for k, payload in enumerate(parts):
            last = k == len(parts) - 1
            res = await self._call("publish", worker_id, epoch, seq, now_ms, 1 if snapshot else 0, k,
                                   1 if last else 0, load.encode() if last and load is not None else "", *payload)
            code = _s(res[0])
            if code == "OK":
                continue
            if code == "RESYNC":
                return PublishResult(Action.RESYNC, _s(res[1]) + "; send a snapshot")
            if code == "NOT_FOUND":
                raise self._not_found(worker_id)
            if code == "STALE_EPOCH":
                what = "snapshot for dead epoch" if snapshot else "stale epoch"
                raise FailedPrecondition(f"{what} {epoch} of worker {worker_id!r}: the live epoch is {_s(res[1])}")
            raise FailedPrecondition(f"seq regression for worker {worker_id!r}: got {seq}, last applied {_s(res[1])}")
        return PublishResult(Action.ACK)

    async def publish(self, worker_id: str, epoch: int, seq: int, events: list[KVCacheEvent],
                      now_ms: int, load: Load | None = None) -> PublishResult:
        return await self._publish(worker_id, epoch, seq, now_ms, False,
                                   split_payload(events, self.max_blocks_per_call), load)

    async def snapshot(self, worker_id: str, epoch: int, seq: int, hashes: list[bytes], now_ms: int,
                       load: Load | None = None) -> PublishResult:
        n = self.max_blocks_per_call
        parts = [[b"".join(hashes[i:i + n])] for i in range(0, len(hashes), n)] or [[]]
        return await self._publish(worker_id, epoch, seq, now_ms, True, parts, load)

    async def lookup(self, model_id: str, hashes: list[bytes], now_ms: int) -> list[WorkerMatch]:
        live, pairs = await self._call("lookup", model_id, now_ms, HASH_LEN, b"".join(hashes))
        matched = {pairs[i]: int(pairs[i + 1]) for i in range(0, len(pairs), 2)}
        info = await self._worker_info(model_id, live)
        return [WorkerMatch(wid, addr, matched.get(raw, 0), load, bs) for raw in live
                for wid, addr, bs, load in (info[raw],)]

    # -- the address / load cache of Lookup ------------------------------------------------
    # NOTE: liveness and matches always come from Redis in the lookup's one round trip; only
    # address, block size and load (reported with heartbeats and event batches) come from this
    # cache, refreshed every INFO_REFRESH_S by a task on the loop. A worker missing from it is
    # read at once (a second round trip, once per new worker).
    INFO_REFRESH_S = 0.1

    async def _worker_info(self, model_id: str, live: list[bytes]) -> dict[bytes, tuple[str, str, int, Load]]:
        cached = self._info.get(model_id)
        if cached is None:
            cached = self._info[model_id] = {}
            if self._refresher is None:
                self._refresher = asyncio.get_running_loop().create_task(self._refresh_loop())
        missing = [w for w in live if w not in cached]
        if missing:
            fresh = await self._redis(self._r.hmget(self.prefix + "ld:" + model_id, missing))
            cached.update((w, self._parse_info(w, raw)) for w, raw in zip(missing, fresh, strict=True))
        return cached

    @staticmethod
    def _parse_info(wid: bytes, raw: bytes | None) -> tuple[str, str, int, Load]:
        addr, bs, load = _s(raw or b"||").split("|", 2)
        return _s(wid), addr, int(bs or 0), Load.decode(load)

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.INFO_REFRESH_S)
            for model_id in list(self._info):
                try:
                    raw = await self._r.hgetall(self.prefix + "ld:" + model_id)
                except redis.RedisError:
                    continue  # lookups report Redis errors; the cache just stays as it was
                self._info[model_id] = {w: self._parse_info(w, v) for w, v in raw.items()}

    async def holders(self, block_hash: bytes, now_ms: int) -> list[str]:
        return sorted(_s(w) for w in await self._call("admin", "holders", block_hash, now_ms))

    async def workers(self, now_ms: int, include_expired: bool = False) -> list[WorkerInfo]:
        ids = [_s(w) for w in await self._redis(self._r.zrange(self._key, 0, -1))]
        pipe = self._r.pipeline(transaction=True)
        for wid in ids:
            pipe.hgetall(self.prefix + "w:" + wid)
            pipe.zcard(self.prefix + "l:" + wid)
        replies = await self._redis(pipe.execute())
        out = []
        for k, wid in enumerate(ids):
            h = {_s(key): _s(v) for key, v in replies[2 * k].items()}
            if not h:
                continue  # removed between the two reads
            reg = Registration(wid, h["addr"], h["model"], int(h["bs"]), h["algo"], int(h["nb"]), int(h["epoch"]))
            info = WorkerInfo(reg, int(h["seq"]), int(replies[2 * k + 1]), Load.decode(h["load"]), int(float(h["lease"])))
            if include_expired or info.live(now_ms):
                out.append(info)
        return sorted(out, key=lambda i: i.registration.worker_id)

    async def stats(self, now_ms: int) -> IndexStats:
        infos = await self.workers(now_ms, include_expired=True)
        nblocks = await self._redis(self._r.hlen(self.prefix + "bh"))
        live = [i for i in infos if i.live(now_ms)]
        models: dict[str, ModelSpec] = {}
        for i in infos:
            r = i.registration
            models.setdefault(r.model_id, ModelSpec(r.model_id, r.block_size, r.hash_algorithm))
        return IndexStats(
            len(live),
            int(nblocks or 0),
            sum(i.blocks_indexed for i in infos),
            [(spec, sum(1 for i in live if i.registration.model_id == m)) for m, spec in sorted(models.items())],
        )

    async def model_spec(self, model_id: str) -> ModelSpec | None:
        spec = await self._redis(self._r.hmget(self.prefix + "m:" + model_id, "bs", "algo"))
        if spec[0] is None:
            return None
        return ModelSpec(model_id, int(spec[0]), _s(spec[1]))

    async def flush_worker(self, worker_id: str) -> int:
        res = await self._call("admin", "flush", worker_id)
        if _s(res[0]) == "NOT_FOUND":
            raise NotFound(f"worker {worker_id!r} is not registered")
        return int(res[1])

    async def reap_expired(self, now_ms: int) -> int:
        return int(await self._call("admin", "reap", now_ms))

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._refresher
            self._refresher = None
        await self._fast.close()
        await self._r.aclose()
