"""The index's shards on one Redis or a Redis Cluster: nodes, the slot map, MOVED / ASK, failover,
Lookups from replicas, and script calls in one round trip however many shards.

A namespace's index lives in ``shards`` Redis Cluster hash tags (:func:`shard_tags`), so each shard
is one slot and its scripts stay atomic; a worker's keys live on its home shard (:func:`home_shard`).
:class:`ShardedRedis` finds which node holds each shard (CLUSTER SLOTS; one Redis that is not a
cluster holds them all), sends a round of commands to the nodes at once and reads the replies, and
follows the cluster through failovers and slot moves. It knows nothing of the index's keys beyond the
namespace's shard count; the index (store_redis.py) is its caller, with its Lua scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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

from kvmesh.contract.errors import FailedPrecondition, Unavailable
from kvmesh.kv_service.redis_node import ScriptConnections

log = logging.getLogger("kvmesh.kv_service")


def as_str(raw: bytes | str | None) -> str:
    """A reply's bytes as text (None: "")."""
    return raw.decode() if isinstance(raw, bytes) else (raw or "")


_s = as_str


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


class ShardedRedis:
    """A namespace's shards and the Redis nodes that hold them.

    Args:
    url: ``redis://[:password@]host:port/db`` (``rediss://`` for TLS): one Redis, or any node of
        a Redis Cluster (found out at the first call; the other nodes are found with CLUSTER SLOTS
        and reached with the same password and TLS settings).
    namespace: the namespace's hash tag (one shard), or the root of its shards' tags.
    shards: how many shards (hash tags) the namespace is spread over (:func:`shard_tags`).
    scripts: the Lua scripts callable by name (name -> source): loaded again where a node lost them
        (a restart, a promoted replica).
    max_connections: connections to each Redis node at most; a call waits for a free one.
    read_replicas: :meth:`read` goes to each shard's replicas (round robin over those in sync); a
        shard without one is read on its master. Everything else stays on the masters.

    The client (redis.asyncio) binds its connections to the event loop that first uses them: use
    one ShardedRedis from one loop.
    """

    def __init__(self, url: str, namespace: str, shards: int, scripts: Mapping[str, str], *,
                 socket_timeout: float = 2.0, max_connections: int = 16, read_replicas: bool = False) -> None:
        self.url = url
        self.namespace = namespace
        self.shards = shards
        self.read_replicas = read_replicas
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
        self.tags = shard_tags(namespace, shards)
        self.prefixes = [f"kvm:{{{t}}}:" for t in self.tags]
        self.keys = [p + "workers" for p in self.prefixes]
        """Per shard, the KEYS[1] that routes a script call to the shard's slot."""
        self._layout_key = f"kvm:{{{namespace}}}:shards"
        self._closed = False
        self._shas: dict[str, str] = {}
        self._sources: dict[str, str] = {}
        for name, source in scripts.items():
            sha = hashlib.sha1(source.encode()).hexdigest()
            self._shas[name], self._sources[sha] = sha, source

    def sha(self, script: str) -> str:
        """The SHA-1 a script is called by (EVALSHA)."""
        return self._shas[script]

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
    async def round(self, cmds: Sequence[tuple[int, tuple | Tx]], retried: bool = False,
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
            script = next(c for c in args.cmds if c[0].startswith("EVALSHA")) if isinstance(args, Tx) else args
            try:
                await node.command("SCRIPT", "LOAD", self._sources[script[1]])
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if replica is not None:
                    raise _ReplicaFailed(replica, exc) from None
                self._failed()
                raise Unavailable(f"the index's Redis is unreachable: {exc}") from None
            return (await self.round([cmd], retried=True, route={shard: replica} if replica else None))[0]
        if replica is not None:
            # NOTE: a replica that redirects (it was promoted or demoted), is loading or lost its master
            # (replica-serve-stale-data no): the master answers this one; the next check decides on it.
            raise _ReplicaFailed(replica, err)
        if isinstance(err, (MovedError, ReadOnlyError)) and not retried:
            # NOTE: the slot moved (failover, resharding): read the map now and try once more
            self._stale_since = 0.0
            return (await self.round([cmd], retried=True))[0]
        if isinstance(err, (AskError, TryAgainError, ClusterDownError, MovedError, ReadOnlyError)):
            self._failed()
            raise Unavailable(f"the index's Redis Cluster cannot serve shard {shard} now: {err}") from None
        raise err

    def script(self, shard: int, script: str, args: Sequence[Any]) -> tuple[int, tuple]:
        """A script call on a shard: EVALSHA with the shard's key and key prefix before ``args``."""
        return shard, ("EVALSHA", self._shas[script], 1, self.keys[shard], self.prefixes[shard], *args)

    async def on(self, shard: int, script: str, *args: Any) -> Any:
        """One script call on one shard."""
        return (await self.round([self.script(shard, script, args)]))[0]

    async def call(self, script: str, worker_id: str, *args: Any) -> Any:
        """One script call on the worker's home shard (``args`` follow the worker id)."""
        return await self.on(self.home(worker_id), script, worker_id, *args)

    async def each(self, script: str, *args: Any) -> list[Any]:
        """The same script call on every shard, in one round."""
        return await self.round([self.script(k, script, args) for k in range(self.shards)])

    async def ping(self) -> None:
        """One PING round trip to every node that holds a shard, on the path every script call takes
        (and the namespace's shard count checked: FailedPrecondition)."""
        await self.round([(k, ("PING",)) for k in range(self.shards)])

    # -- reads from replicas ------------------------------------------------------------------
    REPLICA_CHECK_S = 1.0
    """With read_replicas: how often the slot map is read again and each replica asked about its link
    to its master (INFO replication, :func:`replica_readable`)."""
    REPLICA_STALE_S = 5
    """A replica whose link to its master broke (the master died: a failover takes the node timeout
    and an election) keeps answering Lookups for this many seconds of it, with what it had: a
    failover does not stop the Lookups. A replica that never synced since it started (an empty
    dataset) or is syncing answers none."""

    async def read(self, cmds: Sequence[tuple[int, tuple | Tx]]) -> list[Any]:
        """A round of reads (a Lookup's): with read_replicas on one in-sync replica of each shard (round
        robin), a shard without one on its master. A replica that fails the read is dropped until the
        next check, and the masters answer this round."""
        if not self.read_replicas:
            return await self.round(cmds)
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
                replies = await self.round(cmds, route=route)
            except _ReplicaFailed as exc:
                exc.node.in_sync = False
                log.warning("a Lookup on a Redis replica failed (%s); the masters answer until it is in sync again", exc)
            else:
                self.replica_lookups += len(route)
                return replies
        return await self.round(cmds)

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

    async def close(self) -> None:
        self._closed = True
        if self._replica_check is not None and not self._replica_check.done():
            self._replica_check.cancel()
            with contextlib.suppress(BaseException):
                await self._replica_check
        for node in self._nodes.values():
            await node.close()
