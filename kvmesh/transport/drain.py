"""A server's graceful stop: RPCs in flight get a grace period, new ones are refused."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("kvmesh.transport.drain")


SHUTTING_DOWN = "this server is shutting down: retry on another replica"


class DrainGate:
    """The RPCs in flight, for a graceful stop: once closed, new RPCs are refused with UNAVAILABLE
    (saying why) while those in flight get the grace to finish; past it they end UNAVAILABLE too.

    NOTE: grpc's own ``stop(grace)`` refuses new calls as well, but one arriving on an open
    connection is answered CANCELLED (a code clients do not retry, and a lie: nobody cancelled),
    and one on a new connection meets a closed port. Health and reflection are not gated: probes
    read NOT_SERVING while it drains.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self._idle: asyncio.Event | None = None
        self.closed = False
        self.expired = False

    def enter(self) -> asyncio.Task | None:
        """Counts the calling RPC's task in and returns it; None when closed (refuse the RPC)."""
        if self.closed:
            return None
        task = asyncio.current_task()
        assert task is not None  # grpc.aio runs every RPC in a task
        self._tasks.add(task)
        return task

    def leave(self, task: asyncio.Task) -> None:
        # NOTE: the task that entered, not current_task(): a stream whose client went away may
        # be closed (its finally run) from the loop's async-generator finalizer, in another task.
        self._tasks.discard(task)
        if not self._tasks and self._idle is not None:
            self._idle.set()

    async def drain(self, grace: float) -> None:
        """Closes the gate, waits up to ``grace`` for the RPCs in flight, then cuts the rest."""
        self.closed = True
        if self._tasks:
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except asyncio.TimeoutError:  # noqa: UP041 - TimeoutError only from Python 3.11
                log.warning("%.1fs grace over with %d RPC(s) in flight: ending them", grace, len(self._tasks))
        self.expired = True
        for task in list(self._tasks):
            task.cancel()  # the wrapper turns it into UNAVAILABLE (see _gated)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1.0)
