"""The Redis-backed index: every multi-key update is one Lua script (atomic), one round trip.

The index of a namespace lives in one or more **shards**, each a Redis Cluster hash tag (so each
shard is one slot and its scripts stay atomic). A worker's registration, blocks, LRU order and
epoch/seq live on its **home shard** (:func:`home_shard`): a worker's events are one
script on one shard, as before sharding. A Lookup asks every shard in one parallel round and
merges the answers (docs/kv-service.md "Shards").

Key layout of one shard (all under the prefix ``kvm:{<tag>}:``; ``<tag>`` is the namespace with
one shard, :func:`shard_tags` with more):

    bh            HASH  block hash -> ",n1,n2," the worker numbers holding it on their device
                        (refcount = live holders; the field is deleted at 0, so HLEN - 1 = distinct blocks:
                        one field ``table`` keeps the hash a hash table, never a listpack, lua/common.lua)
    hh            HASH  the same for the host KV tier (absent while no worker holds a host-tier block)
    wn / nw       HASH  worker id <-> its number (new at every registration)
    wseq          INT   the last worker number given out
    l:<worker>    ZSET  the worker's device blocks, score = access counter (LRU order)
    hl:<worker>   ZSET  its host-tier blocks, the same
    w:<worker>    HASH  model, addr, bs, algo, nb, epoch, seq, ctr, load, lease, num, engine, pv, hb, hnb, role
                        (pv: the worker's reservation count, kept across its registrations; hb: its host
                        tier's blocks as registered, hnb: the index's cap on them)
    m:<model>     HASH  bs, algo (the model's registered spec)
    mw:<model>    ZSET  worker -> lease expiry (ms)
    ld:<model>    HASH  worker -> "num|block_size|load|addr" (read by every Lookup; parsed once per change;
                        ``num`` names the worker in the holders, which is how Lookup's answer names it)
    pk:<worker>   HASH  request id -> "taken_ms,router,version,prefill,blocks": the routers' pending
                        picks of the worker (the shared router view)
    pd:<model>    HASH  worker -> "picks,prefill,blocks,version": their sums (read by every Lookup)
    workers       ZSET  worker -> lease expiry (ms), every model
    models        SET   model ids

and ``kvm:{<namespace>}:shards`` (STRING): the namespace's shard count, so replicas started with
another ``--shards`` refuse to start instead of splitting the index.

A Lookup is one transaction per shard: the search script (lua/lookup.lua: each holder's match, by
worker number) and three plain reads (the live workers, their "num|bs|load|addr", their pending
picks), all read-only, so with ``read_replicas`` it runs on a replica of the shard.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from pathlib import Path

from redis.exceptions import ResponseError

from kvmesh.contract.block_hash import HASH_LEN
from kvmesh.contract.errors import FailedPrecondition, KVMeshError
from kvmesh.contract.index_protocol import (
    Pending,
    Registration,
    Reservation,
    ReservationAnswer,
    WorkerInfo,
    WorkerMatch,
)
from kvmesh.contract.types import BlockStored, KVCacheEvent, Load, ModelSpec, Tier
from kvmesh.kv_service.config import LOOKUP_WALKS, RedisStoreConfig
from kvmesh.kv_service.index import Action, BlockIndex, IndexStats, PublishResult
from kvmesh.kv_service.redis_cluster import ShardedRedis, Tx
from kvmesh.kv_service.redis_cluster import as_str as _s
from kvmesh.kv_service.redis_payloads import as_map, holders_by_worker, pending_of, split_info, split_payload
from kvmesh.kv_service.refusals import Refusal, refuse

_LUA_DIR = Path(__file__).parent / "lua"
BH_TABLE_FIELD = "table"
"""The one field of ``bh`` that is no block hash (lua/common.lua: it keeps the hash a hash table)."""

_DEFAULTS = RedisStoreConfig()
DEFAULT_MAX_BLOCKS_PER_CALL = _DEFAULTS.max_blocks_per_call
DEFAULT_MAX_CONNECTIONS = _DEFAULTS.redis_connections


SCRIPTS = ("register", "heartbeat", "publish", "lookup", "lookup_linear", "admin", "reserve")
"""The store's Lua scripts (lua/<name>.lua, each after lua/common.lua)."""


def _script_source(name: str) -> str:
    return (_LUA_DIR / "common.lua").read_text() + "\n" + (_LUA_DIR / f"{name}.lua").read_text()


class RedisIndex(BlockIndex):
    """Args:
    url: ``redis://[:password@]host:port/db`` (``rediss://`` for TLS): one Redis, or any node of
        a Redis Cluster (found out at the first call; the other nodes are found with CLUSTER SLOTS
        and reached with the same password and TLS settings).
    namespace: hash tag of the keys; deployments sharing a Redis use different ones.
    max_blocks_per_call: hashes per event-apply script call. Redis runs one script at a time and
        nothing else meanwhile, so a Lookup arriving during a 20 ms batch of thousands of blocks
        would wait for all of it; in parts of this size it waits for at most one part.
    max_connections: connections to each Redis node at most; a call waits for a free one.
    shards: how many shards (hash tags) the index is spread over; on a Redis Cluster with
        ``shards`` = masters each shard lands on its own master (:func:`shard_tags`). One Redis
        holds any number of shards (the semantics are the same; tests use that).
    read_replicas: Lookups go to each shard's replicas (round robin over those in sync), with
        EVALSHA_RO; a shard without one is read on its master. Everything else stays on the masters.
    lookup_walk: ``search`` (lua/lookup.lua) or ``linear`` (lua/lookup_linear.lua, the walk it
        replaced, with its reply; kept as the benchmarks' baseline).
    ingest_loop: ``apart``: :meth:`writer` gives event batches a RedisIndex of their own (its own
        connections, for its own event loop); ``shared``: they go through this one.

    The client (redis.asyncio) binds its connections to the event loop that first uses them: use
    one RedisIndex from one loop.
    """

    name = "redis"

    def __init__(self, url: str, namespace: str = _DEFAULTS.namespace, socket_timeout: float = 2.0,
                 max_blocks_per_call: int = DEFAULT_MAX_BLOCKS_PER_CALL,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, shards: int = _DEFAULTS.shards,
                 read_replicas: bool = False, lookup_walk: str = "search",
                 ingest_loop: str = _DEFAULTS.ingest_loop) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", namespace):
            raise ValueError(f"namespace must be 1-64 letters, digits, '_', '.', '-', got {namespace!r}")
        RedisStoreConfig(namespace, max_blocks_per_call, max_connections, shards, ingest_loop=ingest_loop).check()
        if lookup_walk not in LOOKUP_WALKS:
            raise ValueError(f"lookup_walk must be one of {', '.join(LOOKUP_WALKS)}, got {lookup_walk!r}")
        self.url = url
        self.socket_timeout = socket_timeout
        self.max_connections = max_connections
        self.ingest_loop = ingest_loop
        self.max_blocks_per_call = max_blocks_per_call
        self.shards = shards
        self.read_replicas = read_replicas
        self.lookup_walk = lookup_walk
        self._lookup_script = "lookup" if lookup_walk == "search" else "lookup_linear"
        self._eval_lookup = "EVALSHA_RO" if read_replicas else "EVALSHA"
        self.namespace = namespace
        self.redis = ShardedRedis(url, namespace, shards, {n: _script_source(n) for n in SCRIPTS},
                                  socket_timeout=socket_timeout, max_connections=max_connections,
                                  read_replicas=read_replicas)
        """The shards' Redis nodes (kv_service/redis_cluster.py): every call of this store goes through it."""
        self.prefixes = self.redis.prefixes
        self.prefix = self.prefixes[0]
        self._info: dict[bytes, tuple[bytes | None, tuple[str, str, int, Load, bytes]]] = {}
        self._matches: dict[bytes, tuple[bytes | None, bytes | None, WorkerMatch, bytes]] = {}

    def writer(self) -> RedisIndex | None:
        """With ``ingest_loop`` apart, a second RedisIndex of the same namespace and settings with connections of
        its own (redis.asyncio binds them to the loop that first uses them); its Lookups would go to the masters."""
        if self.ingest_loop != "apart":
            return None
        return RedisIndex(self.url, self.namespace, self.socket_timeout, self.max_blocks_per_call,
                          self.max_connections, self.shards, lookup_walk=self.lookup_walk, ingest_loop="shared")

    def home(self, worker_id: str) -> int:
        return self.redis.home(worker_id)

    async def ping(self) -> None:
        """One PING round trip to every node that holds a shard, on the path every script call takes
        (and the namespace's shard count checked: FailedPrecondition). With read_replicas, also the
        read-only script call Lookups make (FailedPrecondition before Redis 7: no EVALSHA_RO)."""
        await self.redis.ping()
        if self.read_replicas:
            r = self.redis
            try:
                await r.round([(k, ("EVALSHA_RO", r.sha("lookup"), 1, r.keys[k], r.prefixes[k], HASH_LEN, b""))
                               for k in range(self.shards)])
            except ResponseError as exc:
                raise FailedPrecondition(f"--read-replicas needs Redis 7.0 or later (EVALSHA_RO): {exc}") from None

    # -- registration ----------------------------------------------------------------------
    async def _other_spec(self, reg: Registration, now_ms: int) -> tuple[str, str] | None:
        """A spec other than ``reg``'s that live workers of its model use on the other shards."""
        home = self.home(reg.worker_id)
        others = [k for k in range(self.shards) if k != home]
        specs = await self.redis.round([self.redis.script(k, "admin", ("livespec", reg.model_id, now_ms, reg.worker_id))
                                   for k in others])
        for spec in specs:
            if spec and (_s(spec[0]) != str(reg.block_size) or _s(spec[1]) != reg.hash_algorithm):
                return _s(spec[0]), _s(spec[1])
        return None

    def _spec_error(self, reg: Registration, bs: str, algo: str) -> KVMeshError:
        return refuse(Refusal.SPEC, reg.worker_id, model_id=reg.model_id, spec=(bs, algo),
                      registered=(reg.block_size, reg.hash_algorithm))

    async def register_worker(self, reg: Registration, lease_ttl_ms: int, now_ms: int) -> None:
        # NOTE: the model's spec must agree with its live workers on every shard. With shards,
        # check the others, register on the home shard (which checks its own atomically), check the
        # others again and undo on a disagreement: two workers of different specs registering at
        # the same instant on two shards are then both refused, never both kept.
        if self.shards > 1 and (other := await self._other_spec(reg, now_ms)):
            raise self._spec_error(reg, *other)
        res = await self.redis.call(
            "register", reg.worker_id, reg.address, reg.model_id, reg.block_size, reg.hash_algorithm,
            reg.num_blocks, reg.epoch, now_ms, lease_ttl_ms, reg.engine, reg.host_blocks, reg.host_cap,
            reg.role,
        )
        code = _s(res[0])
        if code == "SPEC":
            raise self._spec_error(reg, _s(res[1]), _s(res[2]))
        if code == "MODEL":
            raise refuse(Refusal.MODEL, reg.worker_id, model_id=reg.model_id, other_model=_s(res[1]))
        if code == "EPOCH":
            raise refuse(Refusal.STALE_REGISTRATION, reg.worker_id, epoch=reg.epoch, live=_s(res[1]))
        if self.shards > 1 and (other := await self._other_spec(reg, now_ms)):
            await self.redis.on(self.home(reg.worker_id), "admin", "unregister", reg.worker_id, reg.epoch)
            raise self._spec_error(reg, *other)

    def _cover(self, load: Load, now_ms: int) -> str:
        """The picks a report covers, for common.lua's cover_picks."""
        cfg = self.pending_config
        ttl_cut = now_ms - cfg.ttl_ms
        if load.reports_admissions:
            return "\n".join(("A", str(ttl_cut), *load.admitted))
        return f"T\n{ttl_cut}\n{now_ms - cfg.grace_ms}"

    async def heartbeat(self, worker_id: str, epoch: int, load: Load, lease_ttl_ms: int, now_ms: int) -> bool:
        res = await self.redis.call("heartbeat", worker_id, epoch, load.encode(), now_ms, lease_ttl_ms,
                               self._cover(load, now_ms))
        code = _s(res[0])
        if code == "NOT_FOUND":
            raise refuse(Refusal.NOT_REGISTERED, worker_id)
        if code == "EPOCH":
            raise refuse(Refusal.HEARTBEAT_EPOCH, worker_id, epoch=epoch, live=_s(res[1]))
        return len(res) > 1 and _s(res[1]) != "0"

    # -- events ----------------------------------------------------------------------------
    async def _publish(self, worker_id: str, epoch: int, seq: int, now_ms: int, snapshot: bool,
                       parts: list[list], load: Load | None) -> PublishResult:
        # NOTE: part 0 checks the order (and a snapshot clears the worker); each later part checks
        # the worker's pending (seq, part) and the last commits seq. Lookups and other workers'
        # batches run between parts: the index then holds a prefix of this batch's events.
        for k, payload in enumerate(parts):
            last = k == len(parts) - 1
            report = last and load is not None
            res = await self.redis.call("publish", worker_id, epoch, seq, now_ms, 1 if snapshot else 0, k,
                                   1 if last else 0, load.encode() if report else "",
                                   self._cover(load, now_ms) if report else "", *payload)
            code = _s(res[0])
            if code == "OK":
                continue
            if code == "RESYNC":
                return PublishResult(Action.RESYNC, _s(res[1]) + "; send a snapshot")
            if code == "NOT_FOUND":
                raise refuse(Refusal.NOT_REGISTERED, worker_id)
            if code == "STALE_EPOCH":
                raise refuse(Refusal.STALE_EPOCH, worker_id, epoch=epoch, live=_s(res[1]), snapshot=snapshot)
            raise refuse(Refusal.SEQ_REGRESSION, worker_id, seq=seq, live=_s(res[1]), snapshot=snapshot)
        return PublishResult(Action.ACK)

    async def publish(self, worker_id: str, epoch: int, seq: int, events: list[KVCacheEvent],
                      now_ms: int, load: Load | None = None) -> PublishResult:
        return await self._publish(worker_id, epoch, seq, now_ms, False,
                                   split_payload(events, self.max_blocks_per_call), load)

    async def snapshot(self, worker_id: str, epoch: int, seq: int, hashes: list[bytes], now_ms: int,
                       load: Load | None = None, host_hashes: Sequence[bytes] = ()) -> PublishResult:
        events: list[KVCacheEvent] = [BlockStored(hashes)]
        if host_hashes:
            events.append(BlockStored(list(host_hashes), tier=Tier.HOST))
        return await self._publish(worker_id, epoch, seq, now_ms, True,
                                   split_payload(events, self.max_blocks_per_call), load)

    # -- lookup ----------------------------------------------------------------------------
    async def lookup(self, model_id: str, hashes: list[bytes], now_ms: int) -> list[WorkerMatch]:
        # NOTE: every shard answers for its own workers, all in one round; a worker lives on one shard,
        # so the answers are disjoint and merge by concatenation.
        chain = b"".join(hashes)
        if self.lookup_walk == "linear":
            return await self._lookup_linear(model_id, chain, now_ms)
        out: list[WorkerMatch] = []
        txs = [(k, self._lookup_tx(k, model_id, chain, now_ms)) for k in range(self.shards)]
        cache = self._matches
        for (pairs, upairs), live, infos, pending in await self.redis.read(txs):
            matched = holders_by_worker(pairs)
            reach = holders_by_worker(upairs) if upairs else None
            info, picks = as_map(infos), as_map(pending)
            # NOTE: a worker's answer with 0 blocks is kept per (entry, picks) string pair: with 128
            # workers, rebuilding each answer was most of a Lookup's time in this process.
            for raw in live:
                entry, pick = info.get(raw), picks.get(raw)
                c = cache.get(raw)
                if c is None or c[0] != entry or c[1] != pick:
                    wid, addr, bs, load, num = self._parse_info(raw, entry)
                    if len(cache) >= self.MAX_PARSED:
                        cache.clear()  # workers that left
                    c = cache[raw] = (entry, pick, WorkerMatch(wid, addr, 0, load, bs, pending_of(pick)), num)
                k = matched.get(c[3]) if matched and c[3] else None
                u = reach.get(c[3]) if reach and c[3] else None
                if u and int(u) > int(k or 0):
                    out.append(c[2]._replace(matched_blocks=int(k or 0), host_blocks=int(u) - int(k or 0)))
                else:
                    out.append(c[2]._replace(matched_blocks=int(k)) if k else c[2])
        return out

    def _lookup_tx(self, shard: int, model_id: str, chain: bytes, now_ms: int) -> Tx:
        """One shard's Lookup: each holder's match (lua/lookup.lua), the model's live workers, their
        "num|bs|load|addr" and pending picks; one transaction, so one instant of the shard."""
        pre = self.prefixes[shard]
        return Tx(((self._eval_lookup, self.redis.sha("lookup"), 1, self.redis.keys[shard], pre, HASH_LEN, chain),
                   ("ZRANGEBYSCORE", f"{pre}mw:{model_id}", f"({now_ms}", "+inf"),
                   ("HGETALL", f"{pre}ld:{model_id}"),
                   ("HGETALL", f"{pre}pd:{model_id}")))

    async def _lookup_linear(self, model_id: str, chain: bytes, now_ms: int) -> list[WorkerMatch]:
        """The walk and reply of before the search (lua/lookup_linear.lua): the benchmarks' baseline."""
        live, pairs, pending, infos, upairs = [], [], [], [], []
        sha = self.redis.sha("lookup_linear")
        for shard_live, shard_pairs, shard_pending, shard_infos, shard_upairs in await self.redis.read(
                [(k, (self._eval_lookup, sha, 1, self.redis.keys[k], self.prefixes[k], model_id, now_ms, HASH_LEN, chain))
                 for k in range(self.shards)]):
            live += shard_live
            pairs += shard_pairs
            pending += shard_pending
            infos += shard_infos
            upairs += shard_upairs
        matched = {pairs[i]: int(pairs[i + 1]) for i in range(0, len(pairs), 2)}
        reach = {upairs[i]: int(upairs[i + 1]) for i in range(0, len(upairs), 2)}
        return [WorkerMatch(wid, addr, matched.get(raw, 0), load, bs, pending_of(p),
                            host_blocks=max(0, reach.get(raw, 0) - matched.get(raw, 0)))
                for raw, p, info in zip(live, pending, infos, strict=True)
                for wid, addr, bs, load, _ in (self._parse_info(raw, info),)]

    # -- the shared router view ------------------------------------------------------------
    async def reserve(self, r: Reservation, now_ms: int) -> ReservationAnswer:
        cfg = self.pending_config
        if r.release_worker_id:
            # NOTE: the folded reservation the pick moved away from goes first (on its worker's shard).
            await self.redis.on(self.redis.home(r.release_worker_id), "admin", "release", r.release_worker_id,
                                r.request_id)
        res = await self.redis.call("reserve", r.worker_id, r.model_id, r.router_id, r.request_id,
                               r.prefill_tokens, r.blocks,
                               "" if r.seen_version is None else r.seen_version, now_ms,
                               now_ms - cfg.ttl_ms, cfg.max_per_worker)
        code = _s(res[0])
        if code == "NOT_FOUND":
            raise refuse(Refusal.NOT_LIVE_FOR_MODEL, r.worker_id, model_id=r.model_id)
        if code == "OK":
            return ReservationAnswer(True)
        workers: list[tuple[str, Pending]] = []
        for flat in await self.redis.each("admin", "pending", r.model_id):
            workers += [(_s(flat[i]), pending_of(flat[i + 1])) for i in range(0, len(flat), 2)]
        return ReservationAnswer(False, dict(sorted(workers)))

    # -- a worker's number, address, block size and load, as Lookup reads them -------------------
    # NOTE: every Lookup reads each live worker's "num|bs|load|addr" in its one round (the load must
    # be as fresh as the pending picks its report retired: a cached load would hide a worker's newly
    # admitted requests from the shared router view). Parsing is what costs: a worker's entry is
    # parsed once per distinct string, and the same Load object is handed out until it changes
    # (the server's reply cache checks it by identity).
    MAX_PARSED = 16_384

    def _parse_info(self, wid: bytes, raw: bytes | None) -> tuple[str, str, int, Load, bytes]:
        """(worker id, address, block size, load, worker number: b"" if the entry has none)."""
        cached = self._info.get(wid)
        if cached is not None and cached[0] == raw:
            return cached[1]
        num, bs, load, addr = split_info(raw)
        parsed = (_s(wid), addr, int(bs or 0), Load.decode(load), num)
        if len(self._info) >= self.MAX_PARSED:
            self._info.clear()  # workers that left
        self._info[wid] = (raw, parsed)
        return parsed

    # -- admin -----------------------------------------------------------------------------
    async def holders(self, block_hash: bytes, now_ms: int, tier: Tier = Tier.DEVICE) -> list[str]:
        found = await self.redis.each("admin", "holders", block_hash, now_ms, "h" if tier == Tier.HOST else "")
        return sorted(_s(w) for ws in found for w in ws)

    async def workers(self, now_ms: int, include_expired: bool = False) -> list[WorkerInfo]:
        out = []
        for flat in await self.redis.each("admin", "workers"):
            for k in range(0, len(flat), 16):
                (wid, model, addr, bs, algo, nb, epoch, seq, load, lease, engine, hb, pending, blocks,
                 host_blocks, role) = flat[k:k + 16]
                reg = Registration(_s(wid), _s(addr), _s(model), int(bs), _s(algo), int(nb), int(epoch),
                                   _s(engine) or "kvmesh", int(hb or 0), _s(role) or "both")
                info = WorkerInfo(reg, int(seq), int(blocks), Load.decode(_s(load)), int(float(lease)),
                                  pending_of(pending), int(host_blocks))
                if include_expired or info.live(now_ms):
                    out.append(info)
        return sorted(out, key=lambda i: i.registration.worker_id)

    async def _distinct_blocks(self, key: str = "bh") -> int:
        """Blocks held by any worker (``key``: ``bh``, on a device; ``hh``, in a host tier). A block
        held on two shards is one block: with shards, the shards' block hashes are read (HSCAN, 4096 a
        call) and counted once; an admin call."""
        if self.shards == 1:
            n, table = await self.redis.round([(0, ("HLEN", self.prefix + key)),
                                               (0, ("HEXISTS", self.prefix + key, BH_TABLE_FIELD))])
            return int(n or 0) - int(table or 0)
        seen: set[bytes] = set()
        cursors: dict[int, bytes] = dict.fromkeys(range(self.shards), b"0")
        while cursors:
            shards = list(cursors)
            pages = await self.redis.round([(k, ("HSCAN", self.prefixes[k] + key, cursors[k], "COUNT", 4096))
                                       for k in shards])
            for k, (cursor, flat) in zip(shards, pages, strict=True):
                seen.update(f for f in flat[0::2] if len(f) == HASH_LEN)  # not the table field
                if cursor in (b"0", 0, "0"):
                    del cursors[k]
                else:
                    cursors[k] = cursor
        return len(seen)

    async def stats(self, now_ms: int) -> IndexStats:
        infos = await self.workers(now_ms, include_expired=True)
        nblocks = await self._distinct_blocks()
        nhost = await self._distinct_blocks("hh")
        live = [i for i in infos if i.live(now_ms)]
        models: dict[str, ModelSpec] = {}
        for i in infos:
            r = i.registration
            models.setdefault(r.model_id, ModelSpec(r.model_id, r.block_size, r.hash_algorithm))
        return IndexStats(
            len(live),
            nblocks,
            sum(i.blocks_indexed for i in infos),
            [(spec, sum(1 for i in live if i.registration.model_id == m)) for m, spec in sorted(models.items())],
            nhost,
            sum(i.host_blocks_indexed for i in infos),
        )

    async def model_spec(self, model_id: str) -> ModelSpec | None:
        # NOTE: with shards, the spec of the shard whose worker of the model was renewed last (a
        # shard may keep the spec of expired workers not reaped yet; the newest registration wins,
        # as it overwrites the spec on one Redis).
        best: tuple[float, int, str] | None = None
        for spec in await self.redis.each("admin", "spec", model_id):
            if spec and (best is None or float(spec[2]) > best[0]):
                best = (float(spec[2]), int(spec[0]), _s(spec[1]))
        return None if best is None else ModelSpec(model_id, best[1], best[2])

    async def flush_worker(self, worker_id: str) -> int:
        res = await self.redis.on(self.home(worker_id), "admin", "flush", worker_id)
        if _s(res[0]) == "NOT_FOUND":
            raise refuse(Refusal.NOT_REGISTERED_ADMIN, worker_id)
        return int(res[1])

    async def reap_expired(self, now_ms: int) -> int:
        if self.shards == 1:
            return int(await self.redis.on(0, "admin", "reap", now_ms))
        # NOTE: shard by shard, so a shard that is down does not stop the others' reaping.
        done = await asyncio.gather(*(self.redis.on(k, "admin", "reap", now_ms) for k in range(self.shards)),
                                    return_exceptions=True)
        failed = [r for r in done if isinstance(r, BaseException)]
        if len(failed) == len(done):
            raise failed[0]
        return sum(int(r) for r in done if not isinstance(r, BaseException))

    async def close(self) -> None:
        await self.redis.close()
