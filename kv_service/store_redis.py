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

import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from kvmesh.contract.errors import FailedPrecondition, NotFound, Unavailable
from kvmesh.contract.types import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, Load, ModelSpec
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


def _script_source(name: str) -> str:
    return (_LUA_DIR / "common.lua").read_text() + "\n" + (_LUA_DIR / f"{name}.lua").read_text()


def _s(raw: bytes | str | None) -> str:
    return raw.decode() if isinstance(raw, bytes) else (raw or "")


class RedisIndex(BlockIndex):
    """Args:
    url: ``redis://[:password@]host:port/db`` (``rediss://`` for TLS).
    namespace: hash tag of the keys; deployments sharing a Redis use different ones.
    """

    name = "redis"

    def __init__(self, url: str, namespace: str = "kvmesh", socket_timeout: float = 2.0) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", namespace):
            raise ValueError(f"namespace must be 1-64 letters, digits, '_', '.', '-', got {namespace!r}")
        self._r = redis.Redis.from_url(url, socket_timeout=socket_timeout, socket_connect_timeout=socket_timeout)
        self.prefix = f"kvm:{{{namespace}}}:"
        self._key = self.prefix + "workers"  # the KEYS[1] that routes every script to the slot
        self._info: dict[str, dict[bytes, tuple[str, str, int, Load]]] = {}
        self._refresher: threading.Thread | None = None
        self._closed = threading.Event()
        self._scripts = {
            n: self._r.register_script(_script_source(n))
            for n in ("register", "heartbeat", "publish", "lookup", "admin")
        }

    def _call(self, script: str, *args: Any) -> Any:
        try:
            return self._scripts[script](keys=[self._key], args=[self.prefix, *args])
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise Unavailable(f"the index's Redis is unreachable: {exc}") from None

    def _redis(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise Unavailable(f"the index's Redis is unreachable: {exc}") from None

    def ping(self) -> float:
        return self._redis(self._r.ping)

    @staticmethod
    def _not_found(worker_id: str) -> NotFound:
        return NotFound(f"worker {worker_id!r} is not registered or its lease expired; register it again")

    def register_worker(self, reg: Registration, lease_ttl_ms: int, now_ms: int) -> None:
        res = self._call(
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

    def heartbeat(self, worker_id: str, epoch: int, load: Load, lease_ttl_ms: int, now_ms: int) -> None:
        res = self._call("heartbeat", worker_id, epoch, load.encode(), now_ms, lease_ttl_ms)
        code = _s(res[0])
        if code == "NOT_FOUND":
            raise self._not_found(worker_id)
        if code == "EPOCH":
            raise FailedPrecondition(
                f"heartbeat for epoch {epoch} but worker {worker_id!r} is registered with epoch {_s(res[1])}"
            )

    def _publish(self, worker_id: str, epoch: int, seq: int, now_ms: int, snapshot: bool, payload: list) -> PublishResult:
        res = self._call("publish", worker_id, epoch, seq, now_ms, 1 if snapshot else 0, *payload)
        code = _s(res[0])
        if code == "OK":
            return PublishResult(Action.ACK)
        if code == "RESYNC":
            return PublishResult(Action.RESYNC, _s(res[1]) + "; send a snapshot")
        if code == "NOT_FOUND":
            raise self._not_found(worker_id)
        if code == "STALE_EPOCH":
            what = "snapshot for dead epoch" if snapshot else "stale epoch"
            raise FailedPrecondition(f"{what} {epoch} of worker {worker_id!r}: the live epoch is {_s(res[1])}")
        raise FailedPrecondition(f"seq regression for worker {worker_id!r}: got {seq}, last applied {_s(res[1])}")

    def publish(self, worker_id: str, epoch: int, seq: int, events: list[KVCacheEvent], now_ms: int) -> PublishResult:
        payload: list = []
        for ev in events:
            if isinstance(ev, BlockStored):
                payload += ["S", len(ev.block_hashes), *ev.block_hashes]
            elif isinstance(ev, BlockRemoved):
                payload += ["R", len(ev.block_hashes), *ev.block_hashes]
            elif isinstance(ev, AllBlocksCleared):
                payload.append("C")
        return self._publish(worker_id, epoch, seq, now_ms, False, payload)

    def snapshot(self, worker_id: str, epoch: int, seq: int, hashes: list[bytes], now_ms: int) -> PublishResult:
        return self._publish(worker_id, epoch, seq, now_ms, True, list(hashes))

    def lookup(self, model_id: str, hashes: list[bytes], now_ms: int) -> list[WorkerMatch]:
        live, pairs = self._call("lookup", model_id, now_ms, *hashes)
        matched = {pairs[i]: int(pairs[i + 1]) for i in range(0, len(pairs), 2)}
        info = self._worker_info(model_id, live)
        return [WorkerMatch(wid, addr, matched.get(raw, 0), load, bs) for raw in live
                for wid, addr, bs, load in (info[raw],)]

    # -- the address / load cache of Lookup ------------------------------------------------
    # NOTE: liveness and matches always come from Redis in the lookup's one round trip; only
    # address, block size and load (which change at most once per heartbeat) come from this
    # cache, refreshed every INFO_REFRESH_S. A worker missing from it is read synchronously.
    INFO_REFRESH_S = 0.1

    def _worker_info(self, model_id: str, live: list[bytes]) -> dict[bytes, tuple[str, str, int, Load]]:
        cached = self._info.get(model_id)
        if cached is None:
            cached = self._info[model_id] = {}
            self._ensure_refresher()
        missing = [w for w in live if w not in cached]
        if missing:
            fresh = self._redis(lambda: self._r.hmget(self.prefix + "ld:" + model_id, missing))
            cached.update((w, self._parse_info(w, raw)) for w, raw in zip(missing, fresh, strict=True))
        return cached

    @staticmethod
    def _parse_info(wid: bytes, raw: bytes | None) -> tuple[str, str, int, Load]:
        addr, bs, load = _s(raw or b"||").split("|", 2)
        return _s(wid), addr, int(bs or 0), Load.decode(load)

    def _ensure_refresher(self) -> None:
        if self._refresher is None:
            self._refresher = threading.Thread(target=self._refresh_loop, name="kv-info-cache", daemon=True)
            self._refresher.start()

    def _refresh_loop(self) -> None:
        while not self._closed.wait(self.INFO_REFRESH_S):
            for model_id in list(self._info):
                try:
                    raw = self._r.hgetall(self.prefix + "ld:" + model_id)
                except redis.RedisError:
                    continue  # lookups report Redis errors; the cache just stays as it was
                self._info[model_id] = {w: self._parse_info(w, v) for w, v in raw.items()}

    def holders(self, block_hash: bytes, now_ms: int) -> list[str]:
        return sorted(_s(w) for w in self._call("admin", "holders", block_hash, now_ms))

    def workers(self, now_ms: int, include_expired: bool = False) -> list[WorkerInfo]:
        def read() -> list[WorkerInfo]:
            ids = [_s(w) for w in self._r.zrange(self._key, 0, -1)]
            pipe = self._r.pipeline(transaction=True)
            for wid in ids:
                pipe.hgetall(self.prefix + "w:" + wid)
                pipe.zcard(self.prefix + "l:" + wid)
            replies = pipe.execute()
            out = []
            for k, wid in enumerate(ids):
                h = {_s(key): _s(v) for key, v in replies[2 * k].items()}
                if not h:
                    continue  # removed between the two reads
                reg = Registration(
                    wid, h["addr"], h["model"], int(h["bs"]), h["algo"], int(h["nb"]), int(h["epoch"])
                )
                info = WorkerInfo(reg, int(h["seq"]), int(replies[2 * k + 1]), Load.decode(h["load"]), int(float(h["lease"])))
                if include_expired or info.live(now_ms):
                    out.append(info)
            return sorted(out, key=lambda i: i.registration.worker_id)

        return self._redis(read)

    def stats(self, now_ms: int) -> IndexStats:
        infos = self.workers(now_ms, include_expired=True)
        nblocks = self._redis(lambda: self._r.hlen(self.prefix + "bh"))
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

    def model_spec(self, model_id: str) -> ModelSpec | None:
        spec = self._redis(lambda: self._r.hmget(self.prefix + "m:" + model_id, "bs", "algo"))
        if spec[0] is None:
            return None
        return ModelSpec(model_id, int(spec[0]), _s(spec[1]))

    def flush_worker(self, worker_id: str) -> int:
        res = self._call("admin", "flush", worker_id)
        if _s(res[0]) == "NOT_FOUND":
            raise NotFound(f"worker {worker_id!r} is not registered")
        return int(res[1])

    def reap_expired(self, now_ms: int) -> int:
        return int(self._call("admin", "reap", now_ms))

    def close(self) -> None:
        self._closed.set()
        self._r.close()
