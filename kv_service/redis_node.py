"""One Redis node's connections, without redis-py's pool: the path of every script call of the index."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError


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
        """As a replica: its link to its master was up at the last check (``ShardedRedis.REPLICA_CHECK_S``)."""
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
