"""Push discovery (WatchWorkers): while anyone watches, one task per replica reads the live worker set
every ``--watch-interval-ms`` (at once after a registration or a leave on this replica) and hands
each change of who is live to every watcher.

NOTE: it reads the store rather than listening to this replica's own calls, so a change made through
another replica (same Redis) or a lease that simply ended reaches this replica's watchers too, one
interval late at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from kvmesh.contract.index_protocol import WorkerInfo

log = logging.getLogger("kvmesh.kv_service")

Membership = frozenset[tuple[str, int, str, str]]


def membership(infos: list[WorkerInfo]) -> Membership:
    """Who is live: (worker id, epoch, address, role) of each; loads left out (they change every step)."""
    return frozenset((i.registration.worker_id, i.registration.epoch, i.registration.address, i.registration.role)
                     for i in infos)


class WorkerWatch:
    """Args:
    live: the live workers now (the index's ``workers``).
    interval_s: how often the set is read while someone watches.
    """

    def __init__(self, live: Callable[[], Awaitable[list[WorkerInfo]]], interval_s: float) -> None:
        self._live = live
        self.interval_s = interval_s
        self._watchers: set[asyncio.Queue[list[WorkerInfo] | None]] = set()
        self._poke: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._closed = False

    @property
    def watchers(self) -> int:
        return len(self._watchers)

    def poke(self) -> None:
        """The set may have changed here (a registration, a leave): read it now, not at the next tick.
        Call on the serving loop."""
        if self._poke is not None:
            self._poke.set()

    async def watch(self) -> AsyncIterator[list[WorkerInfo]]:
        """The live set now, then each changed set; ends at ``close``. A slow watcher skips to the latest."""
        if self._closed:
            return
        queue: asyncio.Queue[list[WorkerInfo] | None] = asyncio.Queue(maxsize=1)
        self._watchers.add(queue)
        if self._task is None:
            self._poke = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())
        try:
            yield await self._live()
            while (infos := await queue.get()) is not None:
                yield infos
        finally:
            self._watchers.discard(queue)

    async def _run(self) -> None:
        assert self._poke is not None
        last: Membership | None = None
        try:
            while self._watchers:
                self._poke.clear()
                try:
                    infos = await self._live()
                except Exception as exc:  # noqa: BLE001 - the store may come back; watchers keep the last set
                    log.warning("worker watch: %s", exc)
                    await asyncio.sleep(self.interval_s)
                    continue
                now = membership(infos)
                if last is not None and now != last:
                    for queue in list(self._watchers):
                        _offer(queue, infos)
                last = now
                with contextlib.suppress(asyncio.TimeoutError):  # noqa: UP041 - 3.10's TimeoutError
                    await asyncio.wait_for(self._poke.wait(), self.interval_s)
        finally:
            self._task = None

    async def close(self) -> None:
        """Ends every watch (the replica stops)."""
        self._closed = True
        for queue in list(self._watchers):
            _offer(queue, None)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def _offer(queue: asyncio.Queue[list[WorkerInfo] | None], item: list[WorkerInfo] | None) -> None:
    """Replaces what the watcher has not read yet: only the newest set matters."""
    with contextlib.suppress(asyncio.QueueEmpty):
        queue.get_nowait()
    queue.put_nowait(item)
