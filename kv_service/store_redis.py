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
    w:<worker>    HASH  model, addr, bs, algo, nb, epoch, seq, ctr, load, lease, num, engine, pv, hb, hnb
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
import contextlib
import dataclasses
import hashlib
import itertools
import logging
import re
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import redis
import redis.asyncio as aioredis
from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    ReadOnlyError,
    ResponseError,
    TryAgainError,
)

from kvmesh.contract.block_hash import HASH_LEN
from kvmesh.contract.errors import FailedPrecondition, KVMeshError, Unavailable
from kvmesh.contract.index_protocol import (
    Registration,
    Reservation,
    ReservationAnswer,
    WorkerInfo,
    WorkerMatch,
)
from kvmesh.contract.types import (
    NO_PENDING,
    AllBlocksCleared,
    BlockStored,
    KVCacheEvent,
    Load,
    ModelSpec,
    Pending,
    Tier,
)
from kvmesh.kv_service.config import LOOKUP_WALKS, RedisStoreConfig
from kvmesh.kv_service.index import Action, BlockIndex, IndexStats, PublishResult
from kvmesh.kv_service.refusals import Refusal, refuse

_LUA_DIR = Path(__file__).parent / "lua"
BH_TABLE_FIELD = "table"
"""The one field of ``bh`` that is no block hash (lua/common.lua: it keeps the hash a hash table)."""
log = logging.getLogger("kvmesh.kv_service")

_DEFAULTS = RedisStoreConfig()
DEFAULT_MAX_BLOCKS_PER_CALL = _DEFAULTS.max_blocks_per_call
DEFAULT_MAX_CONNECTIONS = _DEFAULTS.redis_connections


def _script_source(name: str) -> str:
    return (_LUA_DIR / "common.lua").read_text() + "\n" + (_LUA_DIR / f"{name}.lua").read_text()


def _s(raw: bytes | str | None) -> str:
    return raw.decode() if isinstance(raw, bytes) else (raw or "")


_OPS = {(True, Tier.DEVICE): "S", (False, Tier.DEVICE): "R", (True, Tier.HOST): "HS", (False, Tier.HOST): "HR"}
"""The publish script's op of a (stored?, tier) event."""


def split_payload(events: list[KVCacheEvent], limit: int) -> list[list]:
    """The publish script's payload ('S' / 'R' hashes of the device tier, 'HS' / 'HR' of the host
    tier, 'C'; the hashes of one event as one concatenated string) in parts of at most ``limit``
    hashes each, in event order; a long event is cut across parts. Disk-tier events are not kept
    (the caller counts them)."""
    parts: list[list] = []
    cur: list = []
    size = 0
    for ev in events:
        if isinstance(ev, AllBlocksCleared):
            cur.append("C")
            continue
        op = _OPS.get((isinstance(ev, BlockStored), ev.tier))
        if op is None:
            continue
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


def _by_worker(groups: list) -> dict[bytes, Any]:
    """lookup.lua's {k, "num,num,...", ...} as worker number -> k."""
    return {num: k for i in range(0, len(groups), 2) for k in (groups[i],) for num in groups[i + 1].split(b",")}


def _split_info(raw: bytes | None) -> tuple[bytes, str, str, str]:
    """A worker's ``ld:<model>`` entry "num|bs|load|addr" as (num, bs, load, addr).

    NOTE: an entry written before it named the worker's number ("addr|bs|load", before issue 37)
    has none (b""): the worker matches nothing in Lookups until its next load report (a heartbeat,
    a third of a lease at most) rewrites it."""
    if not raw:
        return b"", "", "", ""
    parts = raw.split(b"|", 3)
    if len(parts) == 4 and parts[0].isdigit():
        return parts[0], _s(parts[1]), _s(parts[2]), _s(parts[3])
    addr, bs, load = (_s(raw).split("|", 2) + ["", ""])[:3]
    return b"", bs, load, addr


def replica_readable(info: str, stale_s: int) -> bool:
    """Whether a replica may answer Lookups, from its INFO replication: a replica, not syncing, whose
    link to its master is up or broke at most ``stale_s`` seconds ago (-1: never up since it started)."""
    fields = dict(line.split(":", 1) for line in info.splitlines() if ":" in line)
    if fields.get("role") != "slave" or fields.get("master_sync_in_progress", "1").strip() != "0":
        return False
    if fields.get("master_link_status", "").strip() == "up":
        return True
    down = int(fields.get("master_link_down_since_seconds", "-1").strip() or -1)
    return 0 <= down <= stale_s


def _as_map(reply: dict | list) -> dict:
    """HGETALL's reply: a map in RESP3 (redis-py's default), a flat list in RESP2."""
    return reply if isinstance(reply, dict) else dict(zip(reply[0::2], reply[1::2], strict=True))


def _pending(raw: bytes | str | None) -> Pending:
    """A worker's "picks,prefill,blocks,version" (pd:<model>); none = no pick ever."""
    if not raw:
        return NO_PENDING
    n, pf, b, v = _s(raw).split(",")
    return Pending(int(n), int(pf), int(b), int(v))


def shard_tags(namespace: str, shards: int) -> list[str]:
    """The hash tag of each shard of a namespace.

    One shard: the namespace itself (the layout before sharding). ``N`` shards: shard ``k`` is
    ``<namespace>/<N>.<k>.<x>`` with the smallest ``x`` whose Redis Cluster slot lies in the
    ``k``-th of ``N`` equal ranges of the 16,384 slots. A cluster whose masters own equal
    contiguous ranges (what ``redis-cli --cluster create`` and managed clusters set up) then
    holds shard ``k`` of ``N = masters`` on master ``k``, and ``N = 2 x masters`` two per master.
    Every replica computes the same tags: nothing is stored to agree on them.
    """
    if shards == 1:
        return [namespace]
    tags = []
    for k in range(shards):
        lo, hi = k * REDIS_CLUSTER_HASH_SLOTS // shards, (k + 1) * REDIS_CLUSTER_HASH_SLOTS // shards
        x = 0
        while not lo <= key_slot(f"{namespace}/{shards}.{k}.{x}".encode()) < hi:
            x += 1
        tags.append(f"{namespace}/{shards}.{k}.{x}")
    return tags


def home_shard(worker_id: str, shards: int) -> int:
    """The shard that holds a worker's registration, blocks and event order: a 64-bit BLAKE2b of
    the id, modulo the shards. NOTE: not CRC32: ids that differ in their last character (w0, w1,
    w2, w3) all have the same CRC32 modulo 3."""
    if shards == 1:
        return 0
    return int.from_bytes(hashlib.blake2b(worker_id.encode(), digest_size=8).digest(), "big") % shards


class ScriptConnections:
    """One Redis node's connections: at most ``size`` open, each call on an idle one (LIFO).

    NOTE: every Lookup and event batch is a script call on this path, so it is the kv_service's
    Redis latency. redis-py's pools add ~30-60 us a call here (a lock or condition, retry and
    observability hooks); a plain Connection's send/read is the round trip and nothing else. These
    are the store's only connections to the node (redis-py's pool only parses the URL): ``size``
    (``--redis-connections``) bounds them.
    """

    def __init__(self, factory: Callable[[], aioredis.Connection], size: int, order: int = 0,
                 address: str = "") -> None:
        self._factory = factory
        self._size = size
        self._free: list[aioredis.Connection] = []
        self._slots: asyncio.Semaphore | None = None
        self.order = order
        """Rounds take connections of several nodes in this order (no two rounds wait on each other)."""
        self.address = address
        self.readonly = False
        """A Redis Cluster replica that serves reads: each new connection says READONLY first (else the
        replica redirects every read to its master)."""
        self.in_sync = False
        """As a replica: its link to its master was up at the last check (``RedisIndex.REPLICA_CHECK_S``)."""
        self._readonly: weakref.WeakSet[aioredis.Connection] = weakref.WeakSet()

    async def acquire(self) -> aioredis.Connection:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self._size)
        await self._slots.acquire()
        conn = self._free.pop() if self._free else self._factory()
        if self.readonly and conn not in self._readonly:
            # NOTE: also an idle connection opened while the node was a master (a failover made it a replica)
            try:
                await conn.send_command("READONLY")
                await conn.read_response()
            except BaseException:
                await self.discard(conn)
                raise
            self._readonly.add(conn)
        return conn

    def release(self, conn: aioredis.Connection) -> None:
        """Back to the idle list: every reply it was sent has been read."""
        self._free.append(conn)
        assert self._slots is not None
        self._slots.release()

    async def discard(self, conn: aioredis.Connection) -> None:
        """Closes a connection whose replies may still arrive (timed out, broken, cancelled):
        the next call would read them."""
        assert self._slots is not None
        self._slots.release()
        with contextlib.suppress(Exception):
            await conn.disconnect()

    async def drop_idle(self) -> None:
        """Closes the idle connections (the node failed or moved: they are likely dead too)."""
        free, self._free = self._free, []
        for conn in free:
            with contextlib.suppress(Exception):
                await conn.disconnect()

    async def command(self, *args: Any) -> Any:
        """One command, one reply (error replies raised)."""
        conn = await self.acquire()
        try:
            await conn.send_command(*args)
            reply = await conn.read_response()
        except ResponseError:
            self.release(conn)  # an error reply: the connection is in step
            raise
        except BaseException:
            await self.discard(conn)
            raise
        self.release(conn)
        return reply

    async def close(self) -> None:
        await self.drop_idle()


@dataclass(slots=True)
class _Topology:
    """Where each shard lives now."""

    shard_node: list[ScriptConnections]
    slots: list[tuple[int, int, tuple[str, int]]]
    """Cluster: (first slot, last slot, master address); empty for one Redis."""
    cluster: bool
    shard_replicas: list[list[ScriptConnections]] = dataclasses.field(default_factory=list)
    """Each shard's replicas (read by Lookups with ``read_replicas``; empty lists without)."""


class _ReplicaFailed(Exception):
    """A Lookup's read on a replica failed (connection, redirect, loading): the master answers it."""

    def __init__(self, node: ScriptConnections, cause: BaseException) -> None:
        super().__init__(f"replica {node.address}: {cause}")
        self.node = node


class Tx(NamedTuple):
    """Commands sent as one MULTI ... EXEC (one reply: EXEC's list)."""

    cmds: tuple[tuple, ...]


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

    The client (redis.asyncio) binds its connections to the event loop that first uses them: use
    one RedisIndex from one loop.
    """

    name = "redis"

    def __init__(self, url: str, namespace: str = _DEFAULTS.namespace, socket_timeout: float = 2.0,
                 max_blocks_per_call: int = DEFAULT_MAX_BLOCKS_PER_CALL,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, shards: int = _DEFAULTS.shards,
                 read_replicas: bool = False, lookup_walk: str = "search") -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", namespace):
            raise ValueError(f"namespace must be 1-64 letters, digits, '_', '.', '-', got {namespace!r}")
        RedisStoreConfig(namespace, max_blocks_per_call, max_connections, shards).check()
        if lookup_walk not in LOOKUP_WALKS:
            raise ValueError(f"lookup_walk must be one of {', '.join(LOOKUP_WALKS)}, got {lookup_walk!r}")
        self.url = url
        self.max_blocks_per_call = max_blocks_per_call
        self.shards = shards
        self.read_replicas = read_replicas
        self.lookup_walk = lookup_walk
        self._lookup_script = "lookup" if lookup_walk == "search" else "lookup_linear"
        self._eval_lookup = "EVALSHA_RO" if read_replicas else "EVALSHA"
        self._rr = itertools.count()
        self._replicas_checked = -float("inf")
        self._replica_check: asyncio.Task | None = None
        self.replica_lookups = 0
        """Shard reads of Lookups a replica answered (a Lookup of N shards counts up to N)."""
        # NOTE: the pool only parses the URL (TLS, password, db, timeouts); it never connects.
        parsed = aioredis.ConnectionPool.from_url(url, socket_timeout=socket_timeout,
                                                  socket_connect_timeout=socket_timeout)
        self._conn_class, self._conn_kwargs = parsed.connection_class, dict(parsed.connection_kwargs)
        self._max_connections = max_connections
        self._nodes: dict[tuple[str, int], ScriptConnections] = {}
        self._seed = self._node((self._conn_kwargs.get("host", "127.0.0.1"), int(self._conn_kwargs.get("port", 6379))))
        self._topo: _Topology | None = None
        self._topo_lock: asyncio.Lock | None = None
        self._stale_since: float | None = None
        self._layout_checked = False
        self.namespace = namespace
        self.tags = shard_tags(namespace, shards)
        self.prefixes = [f"kvm:{{{t}}}:" for t in self.tags]
        self.prefix = self.prefixes[0]
        self._keys = [p + "workers" for p in self.prefixes]  # the KEYS[1] that routes a script to its slot
        self._layout_key = f"kvm:{{{namespace}}}:shards"
        self._info: dict[bytes, tuple[bytes | None, tuple[str, str, int, Load, bytes]]] = {}
        self._matches: dict[bytes, tuple[bytes | None, bytes | None, WorkerMatch, bytes]] = {}
        self._closed = False
        self._scripts: dict[str, tuple[str, str]] = {}
        self._sources: dict[str, str] = {}
        for n in ("register", "heartbeat", "publish", "lookup", "lookup_linear", "admin", "reserve"):
            src = _script_source(n)
            sha = hashlib.sha1(src.encode()).hexdigest()
            self._scripts[n], self._sources[sha] = (sha, src), src

    # -- nodes and topology ----------------------------------------------------------------
    def _node(self, address: tuple[str, int]) -> ScriptConnections:
        node = self._nodes.get(address)
        if node is None:
            kwargs = {**self._conn_kwargs, "host": address[0], "port": address[1]}
            cls = self._conn_class
            node = self._nodes[address] = ScriptConnections(lambda: cls(**kwargs), self._max_connections,
                                                            len(self._nodes), f"{address[0]}:{address[1]}")
        return node

    def home(self, worker_id: str) -> int:
        return home_shard(worker_id, self.shards)

    async def _topology(self) -> _Topology:
        topo = self._topo
        if topo is not None and self._stale_since is None and self._layout_checked:
            return topo
        if self._topo_lock is None:
            self._topo_lock = asyncio.Lock()
        async with self._topo_lock:
            if self._topo is None or (self._stale_since is not None
                                      and time.monotonic() - self._stale_since >= self.REDISCOVER_S):
                self._topo = await self._discover()
                self._stale_since = None
            topo = self._topo
        if not self._layout_checked:
            await self._check_layout(topo)
        return topo

    REDISCOVER_S = 0.1
    """After a node failed, the slot map is read again at most this often (a failover takes the
    cluster's node timeout: until then every call to the dead node fails fast)."""

    async def _discover(self) -> _Topology:
        """Asks the seed (then every other node known) for CLUSTER SLOTS; one Redis: every shard on it."""
        candidates = [self._seed, *(n for n in self._nodes.values() if n is not self._seed)]
        if self._topo is not None:  # NOTE: the last map's masters first: the seed may be the dead one
            candidates = sorted(candidates, key=lambda n: n not in self._topo.shard_node)
        last: Exception | None = None
        for node in candidates:
            try:
                reply = await node.command("CLUSTER", "SLOTS")
            except ResponseError as exc:
                if "cluster support disabled" in str(exc).lower():
                    replicas = await self._plain_replicas() if self.read_replicas else []
                    return _Topology([self._seed] * self.shards, [], False, [replicas] * self.shards)
                last = exc
                continue
            except (redis.ConnectionError, redis.TimeoutError, OSError) as exc:
                last = exc
                await node.drop_idle()
                continue
            slots = []
            replicas_of: dict[tuple[str, int], list[ScriptConnections]] = {}
            for entry in reply:
                host, port = _s(entry[2][0]), int(entry[2][1])
                host = host if host not in ("", "?") else node.address.rsplit(":", 1)[0]
                slots.append((int(entry[0]), int(entry[1]), (host, port)))
                # NOTE: known for the next discovery (a promoted replica) and, with read_replicas, read
                # by Lookups. CLUSTER SLOTS leaves out replicas the cluster marked failed.
                rs = replicas_of.setdefault((host, port), [])
                for replica in entry[3:]:
                    rhost = _s(replica[0])
                    rnode = self._node((rhost if rhost not in ("", "?") else host, int(replica[1])))
                    if self.read_replicas and rnode not in rs:
                        rnode.readonly = True
                        rs.append(rnode)
            shard_node, shard_replicas = [], []
            for k, tag in enumerate(self.tags):
                slot = key_slot(tag.encode())
                owner = next((a for lo, hi, a in slots if lo <= slot <= hi), None)
                if owner is None:
                    raise Unavailable(f"slot {slot} of index shard {k} is served by no Redis Cluster node "
                                      "(the cluster is down or being resharded)")
                shard_node.append(self._node(owner))
                shard_replicas.append(replicas_of.get(owner, []))
            return _Topology(shard_node, slots, True, shard_replicas)
        if isinstance(last, ResponseError):
            raise Unavailable(f"the index's Redis answered CLUSTER SLOTS with an error: {last}")
        raise Unavailable(f"the index's Redis is unreachable: {last}")

    async def _plain_replicas(self) -> list[ScriptConnections]:
        """The replicas of a Redis that is not a cluster, as it names them (ROLE)."""
        try:
            role = await self._seed.command("ROLE")
        except (ResponseError, redis.ConnectionError, redis.TimeoutError, OSError):
            return []
        if _s(role[0]) != "master":
            return []
        return [self._node((_s(r[0]), int(r[1]))) for r in role[2]]

    async def _check_layout(self, topo: _Topology) -> None:
        """Records the namespace's shard count, or refuses another one (replicas must agree)."""
        node = topo.shard_node[0]
        if topo.cluster:
            slot = key_slot(self._layout_key.encode())
            node = next((self._node(a) for lo, hi, a in topo.slots if lo <= slot <= hi), node)
        try:
            await node.command("SET", self._layout_key, self.shards, "NX")
            got = await node.command("GET", self._layout_key)
        except (MovedError, ClusterDownError, TryAgainError, ReadOnlyError) as exc:
            self._stale_since = 0.0
            raise Unavailable(f"the index's Redis Cluster is changing: {exc}") from None
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise Unavailable(f"the index's Redis is unreachable: {exc}") from None
        if _s(got) != str(self.shards):
            raise FailedPrecondition(
                f"namespace {self.namespace!r} is kept in {_s(got)} shard(s) in this Redis (key {self._layout_key}), "
                f"not {self.shards}: every kv_service of a namespace uses the same --shards. Start with "
                f"--shards {_s(got)}, or use a new --namespace (workers register into it within a heartbeat) "
                "and delete the old namespace's keys")
        self._layout_checked = True

    def _failed(self) -> None:
        """A node failed or the map moved: read the slot map again before the next call."""
        if self._stale_since is None:
            self._stale_since = time.monotonic() if self._topo is not None and self._topo.cluster else None

    # -- one round of commands ----------------------------------------------------------------
    async def _round(self, cmds: Sequence[tuple[int, tuple | Tx]], retried: bool = False,
                     route: dict[int, ScriptConnections] | None = None) -> list[Any]:
        """One command (or transaction) per ``(shard, args)``, all sent before any reply is read: one
        round trip however many shards. The commands for one node go pipelined on one connection.
        ``route`` sends a shard's commands to another node than its master (a replica)."""
        topo = await self._topology()
        groups: dict[ScriptConnections, list[int]] = {}
        for i, (shard, _) in enumerate(cmds):
            node = route.get(shard) if route else None
            groups.setdefault(node or topo.shard_node[shard], []).append(i)
        order = sorted(groups, key=lambda n: n.order) if len(groups) > 1 else list(groups)
        replies: list[Any] = [None] * len(cmds)
        held: list[tuple[ScriptConnections, aioredis.Connection, list[int]]] = []
        node: ScriptConnections | None = None
        try:
            for node in order:
                conn = await node.acquire()
                held.append((node, conn, groups[node]))
                packed: list[tuple] = []
                for i in groups[node]:
                    args = cmds[i][1]
                    packed += [("MULTI",), *args.cmds, ("EXEC",)] if isinstance(args, Tx) else [args]
                await conn.send_packed_command(conn.pack_commands(packed))
            while held:
                node, conn, idxs = held[0]
                for i in idxs:
                    args = cmds[i][1]
                    replies[i] = await (self._read_tx(conn, len(args.cmds)) if isinstance(args, Tx)
                                        else self._read_one(conn))
                node.release(conn)
                held.pop(0)
        except BaseException as exc:
            for n, c, _ in held:
                await n.discard(c)
            if isinstance(exc, (redis.ConnectionError, redis.TimeoutError, OSError)):
                if node is not None:
                    await node.drop_idle()
                    if route and node in route.values():
                        raise _ReplicaFailed(node, exc) from None
                self._failed()
                raise Unavailable(f"the index's Redis is unreachable: {exc}") from None
            raise
        for i, reply in enumerate(replies):
            if isinstance(reply, ResponseError):
                node = route.get(cmds[i][0]) if route else None
                replies[i] = await self._after_error(cmds[i], reply, retried, node)
        return replies

    @staticmethod
    async def _read_one(conn: aioredis.Connection) -> Any:
        try:
            return await conn.read_response()
        except ResponseError as exc:
            return exc  # an error reply: the connection is in step

    @classmethod
    async def _read_tx(cls, conn: aioredis.Connection, n: int) -> Any:
        """MULTI's +OK, a +QUEUED per command, EXEC's list: the list, or the first error (a command
        refused when queued: EXEC then aborts; an error inside EXEC's list, e.g. NOSCRIPT)."""
        first: ResponseError | None = None
        for _ in range(n + 1):
            r = await cls._read_one(conn)
            if first is None and isinstance(r, ResponseError):
                first = r
        done = await cls._read_one(conn)
        if first is not None:
            return first
        if isinstance(done, ResponseError):
            return done
        return next((r for r in done if isinstance(r, ResponseError)), done)

    async def _after_error(self, cmd: tuple[int, tuple | Tx], err: ResponseError, retried: bool,
                           replica: ScriptConnections | None = None) -> Any:
        shard, args = cmd
        if isinstance(err, NoScriptError):  # a Redis that restarted (or a promoted replica) lost it
            node = replica or (await self._topology()).shard_node[shard]
            # NOTE: every script of a transaction (a Lookup with its folded Reserve holds two).
            scripts = [c for c in args.cmds if c[0].startswith("EVALSHA")] if isinstance(args, Tx) else [args]
            try:
                for sha in dict.fromkeys(c[1] for c in scripts):
                    await node.command("SCRIPT", "LOAD", self._sources[sha])
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if replica is not None:
                    raise _ReplicaFailed(replica, exc) from None
                self._failed()
                raise Unavailable(f"the index's Redis is unreachable: {exc}") from None
            return (await self._round([cmd], retried=True, route={shard: replica} if replica else None))[0]
        if replica is not None:
            # NOTE: a replica that redirects (it was promoted or demoted), is loading or lost its master
            # (replica-serve-stale-data no): the master answers this one; the next check decides on it.
            raise _ReplicaFailed(replica, err)
        if isinstance(err, (MovedError, ReadOnlyError)) and not retried:
            # NOTE: the slot moved (failover, resharding): read the map now and try once more
            self._stale_since = 0.0
            return (await self._round([cmd], retried=True))[0]
        if isinstance(err, (AskError, TryAgainError, ClusterDownError, MovedError, ReadOnlyError)):
            self._failed()
            raise Unavailable(f"the index's Redis Cluster cannot serve shard {shard} now: {err}") from None
        raise err

    def _script(self, shard: int, script: str, args: Sequence[Any]) -> tuple[int, tuple]:
        return shard, ("EVALSHA", self._scripts[script][0], 1, self._keys[shard], self.prefixes[shard], *args)

    async def _on(self, shard: int, script: str, *args: Any) -> Any:
        """One script call on one shard."""
        return (await self._round([self._script(shard, script, args)]))[0]

    async def _call(self, script: str, worker_id: str, *args: Any) -> Any:
        """One script call on the worker's home shard (``args`` follow the worker id)."""
        return await self._on(self.home(worker_id), script, worker_id, *args)

    async def _each(self, script: str, *args: Any) -> list[Any]:
        """The same script call on every shard, in one round."""
        return await self._round([self._script(k, script, args) for k in range(self.shards)])

    async def ping(self) -> None:
        """One PING round trip to every node that holds a shard, on the path every script call takes
        (and the namespace's shard count checked: FailedPrecondition). With read_replicas, also the
        read-only script call Lookups make (FailedPrecondition before Redis 7: no EVALSHA_RO)."""
        await self._round([(k, ("PING",)) for k in range(self.shards)])
        if self.read_replicas:
            try:
                await self._round([(k, ("EVALSHA_RO", self._scripts["lookup"][0], 1, self._keys[k], self.prefixes[k],
                                        HASH_LEN, b"")) for k in range(self.shards)])
            except ResponseError as exc:
                raise FailedPrecondition(f"--read-replicas needs Redis 7.0 or later (EVALSHA_RO): {exc}") from None

    # -- registration ----------------------------------------------------------------------
    async def _other_spec(self, reg: Registration, now_ms: int) -> tuple[str, str] | None:
        """A spec other than ``reg``'s that live workers of its model use on the other shards."""
        home = self.home(reg.worker_id)
        others = [k for k in range(self.shards) if k != home]
        specs = await self._round([self._script(k, "admin", ("livespec", reg.model_id, now_ms, reg.worker_id))
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
        res = await self._call(
            "register", reg.worker_id, reg.address, reg.model_id, reg.block_size, reg.hash_algorithm,
            reg.num_blocks, reg.epoch, now_ms, lease_ttl_ms, reg.engine, reg.host_blocks, reg.host_cap,
        )
        code = _s(res[0])
        if code == "SPEC":
            raise self._spec_error(reg, _s(res[1]), _s(res[2]))
        if code == "MODEL":
            raise refuse(Refusal.MODEL, reg.worker_id, model_id=reg.model_id, other_model=_s(res[1]))
        if code == "EPOCH":
            raise refuse(Refusal.STALE_REGISTRATION, reg.worker_id, epoch=reg.epoch, live=_s(res[1]))
        if self.shards > 1 and (other := await self._other_spec(reg, now_ms)):
            await self._on(self.home(reg.worker_id), "admin", "unregister", reg.worker_id, reg.epoch)
            raise self._spec_error(reg, *other)

    def _cover(self, load: Load, now_ms: int) -> str:
        """The picks a report covers, for common.lua's cover_picks."""
        cfg = self.pending_config
        ttl_cut = now_ms - cfg.ttl_ms
        if load.reports_admissions:
            return "\n".join(("A", str(ttl_cut), *load.admitted))
        return f"T\n{ttl_cut}\n{now_ms - cfg.grace_ms}"

    async def heartbeat(self, worker_id: str, epoch: int, load: Load, lease_ttl_ms: int, now_ms: int) -> bool:
        res = await self._call("heartbeat", worker_id, epoch, load.encode(), now_ms, lease_ttl_ms,
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
            res = await self._call("publish", worker_id, epoch, seq, now_ms, 1 if snapshot else 0, k,
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
        txs = [(k, self._lookup_tx(k, model_id, chain, now_ms)) for k in range(self.shards)]
        return self._matches_of(await self._read(txs))

    def _matches_of(self, replies: list[Any]) -> list[WorkerMatch]:
        """The shards' Lookup transactions' replies as one answer."""
        out: list[WorkerMatch] = []
        cache = self._matches
        for (pairs, upairs), live, infos, pending in replies:
            matched = _by_worker(pairs)
            reach = _by_worker(upairs) if upairs else None
            info, picks = _as_map(infos), _as_map(pending)
            # NOTE: a worker's answer with 0 blocks is kept per (entry, picks) string pair: with 128
            # workers, rebuilding each answer was most of a Lookup's time in this process.
            for raw in live:
                entry, pick = info.get(raw), picks.get(raw)
                c = cache.get(raw)
                if c is None or c[0] != entry or c[1] != pick:
                    wid, addr, bs, load, num = self._parse_info(raw, entry)
                    if len(cache) >= self.MAX_PARSED:
                        cache.clear()  # workers that left
                    c = cache[raw] = (entry, pick, WorkerMatch(wid, addr, 0, load, bs, _pending(pick)), num)
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
        return Tx(((self._eval_lookup, self._scripts["lookup"][0], 1, self._keys[shard], pre, HASH_LEN, chain),
                   ("ZRANGEBYSCORE", f"{pre}mw:{model_id}", f"({now_ms}", "+inf"),
                   ("HGETALL", f"{pre}ld:{model_id}"),
                   ("HGETALL", f"{pre}pd:{model_id}")))

    async def _lookup_linear(self, model_id: str, chain: bytes, now_ms: int) -> list[WorkerMatch]:
        """The walk and reply of before the search (lua/lookup_linear.lua): the benchmarks' baseline."""
        live, pairs, pending, infos, upairs = [], [], [], [], []
        sha = self._scripts["lookup_linear"][0]
        for shard_live, shard_pairs, shard_pending, shard_infos, shard_upairs in await self._read(
                [(k, (self._eval_lookup, sha, 1, self._keys[k], self.prefixes[k], model_id, now_ms, HASH_LEN, chain))
                 for k in range(self.shards)]):
            live += shard_live
            pairs += shard_pairs
            pending += shard_pending
            infos += shard_infos
            upairs += shard_upairs
        matched = {pairs[i]: int(pairs[i + 1]) for i in range(0, len(pairs), 2)}
        reach = {upairs[i]: int(upairs[i + 1]) for i in range(0, len(upairs), 2)}
        return [WorkerMatch(wid, addr, matched.get(raw, 0), load, bs, _pending(p),
                            host_blocks=max(0, reach.get(raw, 0) - matched.get(raw, 0)))
                for raw, p, info in zip(live, pending, infos, strict=True)
                for wid, addr, bs, load, _ in (self._parse_info(raw, info),)]

    # -- Lookups from replicas ---------------------------------------------------------------
    REPLICA_CHECK_S = 1.0
    """With read_replicas: how often the slot map is read again and each replica asked about its link
    to its master (INFO replication, :func:`replica_readable`)."""
    REPLICA_STALE_S = 5
    """A replica whose link to its master broke (the master died: a failover takes the node timeout
    and an election) keeps answering Lookups for this many seconds of it, with what it had: a
    failover does not stop the Lookups. A replica that never synced since it started (an empty
    dataset) or is syncing answers none."""

    async def _read(self, cmds: Sequence[tuple[int, tuple | Tx]]) -> list[Any]:
        """A Lookup's round: with read_replicas on one in-sync replica of each shard (round robin),
        a shard without one on its master. A replica that fails the read is dropped until the next
        check, and the masters answer this Lookup."""
        if not self.read_replicas:
            return await self._round(cmds)
        topo = await self._topology()
        self._schedule_replica_check()
        turn = next(self._rr)
        route: dict[int, ScriptConnections] = {}
        for k, replicas in enumerate(topo.shard_replicas):
            ok = [r for r in replicas if r.in_sync]
            if ok:
                route[k] = ok[turn % len(ok)]
        if route:
            try:
                replies = await self._round(cmds, route=route)
            except _ReplicaFailed as exc:
                exc.node.in_sync = False
                log.warning("a Lookup on a Redis replica failed (%s); the masters answer until it is in sync again", exc)
            else:
                self.replica_lookups += len(route)
                return replies
        return await self._round(cmds)

    def _schedule_replica_check(self) -> None:
        now = time.monotonic()
        if now - self._replicas_checked < self.REPLICA_CHECK_S or self._closed:
            return
        if self._replica_check is not None and not self._replica_check.done():
            return
        self._replicas_checked = now
        self._replica_check = asyncio.get_running_loop().create_task(self.check_replicas())

    def replicas(self) -> list[tuple[int, str, bool]]:
        """(shard, address, in sync) of each replica Lookups may read, as last discovered and checked."""
        topo = self._topo
        return [(k, r.address, r.in_sync) for k, rs in enumerate(topo.shard_replicas if topo else []) for r in rs]

    async def check_replicas(self) -> None:
        """Reads the slot map again (new and failed-over replicas) and marks each replica in sync or
        not (its master link up, no sync in progress). Runs every ``REPLICA_CHECK_S`` while Lookups
        arrive; never raises."""
        try:
            topo = await self._discover()
        except Exception as exc:  # noqa: BLE001 - a background check: the next one tries again
            log.warning("reading the Redis Cluster's slot map for replica reads failed: %s", exc)
            topo = self._topo
        if topo is None:
            return
        if self._topo is not None and self._stale_since is None:
            self._topo = topo
        replicas = {r for rs in topo.shard_replicas for r in rs}

        async def check(node: ScriptConnections) -> None:
            try:
                info = _s(await asyncio.wait_for(node.command("INFO", "replication"), self.REPLICA_CHECK_S))
            except (ResponseError, redis.ConnectionError, redis.TimeoutError, OSError, asyncio.TimeoutError):
                node.in_sync = False
                return
            node.in_sync = replica_readable(info, self.REPLICA_STALE_S)

        await asyncio.gather(*(check(r) for r in replicas))

    # -- the shared router view ------------------------------------------------------------
    def _reserve_args(self, r: Reservation, now_ms: int) -> tuple:
        cfg = self.pending_config
        return (r.worker_id, r.model_id, r.router_id, r.request_id, r.prefill_tokens, r.blocks,
                "" if r.seen_version is None else r.seen_version, now_ms, now_ms - cfg.ttl_ms, cfg.max_per_worker)

    async def reserve(self, r: Reservation, now_ms: int) -> ReservationAnswer:
        if r.release_worker_id:
            # NOTE: the folded reservation the pick moved away from goes first (on its worker's shard).
            await self._on(self.home(r.release_worker_id), "admin", "release", r.release_worker_id, r.request_id)
        res = await self._on(self.home(r.worker_id), "reserve", *self._reserve_args(r, now_ms))
        code = _s(res[0])
        if code == "NOT_FOUND":
            raise refuse(Refusal.NOT_LIVE_FOR_MODEL, r.worker_id, model_id=r.model_id)
        if code == "OK":
            return ReservationAnswer(True)
        workers: list[tuple[str, Pending]] = []
        for flat in await self._each("admin", "pending", r.model_id):
            workers += [(_s(flat[i]), _pending(flat[i + 1])) for i in range(0, len(flat), 2)]
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
        num, bs, load, addr = _split_info(raw)
        parsed = (_s(wid), addr, int(bs or 0), Load.decode(load), num)
        if len(self._info) >= self.MAX_PARSED:
            self._info.clear()  # workers that left
        self._info[wid] = (raw, parsed)
        return parsed

    # -- admin -----------------------------------------------------------------------------
    async def holders(self, block_hash: bytes, now_ms: int, tier: Tier = Tier.DEVICE) -> list[str]:
        found = await self._each("admin", "holders", block_hash, now_ms, "h" if tier == Tier.HOST else "")
        return sorted(_s(w) for ws in found for w in ws)

    async def workers(self, now_ms: int, include_expired: bool = False) -> list[WorkerInfo]:
        out = []
        for flat in await self._each("admin", "workers"):
            for k in range(0, len(flat), 15):
                (wid, model, addr, bs, algo, nb, epoch, seq, load, lease, engine, hb, pending, blocks,
                 host_blocks) = flat[k:k + 15]
                reg = Registration(_s(wid), _s(addr), _s(model), int(bs), _s(algo), int(nb), int(epoch),
                                   _s(engine) or "kvmesh", int(hb or 0))
                info = WorkerInfo(reg, int(seq), int(blocks), Load.decode(_s(load)), int(float(lease)),
                                  _pending(pending), int(host_blocks))
                if include_expired or info.live(now_ms):
                    out.append(info)
        return sorted(out, key=lambda i: i.registration.worker_id)

    async def _distinct_blocks(self, key: str = "bh") -> int:
        """Blocks held by any worker (``key``: ``bh``, on a device; ``hh``, in a host tier). A block
        held on two shards is one block: with shards, the shards' block hashes are read (HSCAN, 4096 a
        call) and counted once; an admin call."""
        if self.shards == 1:
            n, table = await self._round([(0, ("HLEN", self.prefix + key)), (0, ("HEXISTS", self.prefix + key,
                                                                                  BH_TABLE_FIELD))])
            return int(n or 0) - int(table or 0)
        seen: set[bytes] = set()
        cursors: dict[int, bytes] = dict.fromkeys(range(self.shards), b"0")
        while cursors:
            shards = list(cursors)
            pages = await self._round([(k, ("HSCAN", self.prefixes[k] + key, cursors[k], "COUNT", 4096))
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
        for spec in await self._each("admin", "spec", model_id):
            if spec and (best is None or float(spec[2]) > best[0]):
                best = (float(spec[2]), int(spec[0]), _s(spec[1]))
        return None if best is None else ModelSpec(model_id, best[1], best[2])

    async def flush_worker(self, worker_id: str) -> int:
        res = await self._on(self.home(worker_id), "admin", "flush", worker_id)
        if _s(res[0]) == "NOT_FOUND":
            raise refuse(Refusal.NOT_REGISTERED_ADMIN, worker_id)
        return int(res[1])

    async def reap_expired(self, now_ms: int) -> int:
        if self.shards == 1:
            return int(await self._on(0, "admin", "reap", now_ms))
        # NOTE: shard by shard, so a shard that is down does not stop the others' reaping.
        done = await asyncio.gather(*(self._on(k, "admin", "reap", now_ms) for k in range(self.shards)),
                                    return_exceptions=True)
        failed = [r for r in done if isinstance(r, BaseException)]
        if len(failed) == len(done):
            raise failed[0]
        return sum(int(r) for r in done if not isinstance(r, BaseException))

    async def close(self) -> None:
        self._closed = True
        if self._replica_check is not None and not self._replica_check.done():
            self._replica_check.cancel()
            with contextlib.suppress(BaseException):
                await self._replica_check
        for node in self._nodes.values():
            await node.close()
