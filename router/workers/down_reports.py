"""A front's word that a worker is unreachable, passed to every front through the kv_service
(LeaveWorker): the worker leaves each router's and picker's live set at the next push, within a
second, instead of at its lease's end. It comes back when it heartbeats again (its lease gone, it
registers again): a false report costs one heartbeat interval, no more.

What counts as unreachable (router/core/attempts.py's UNAVAILABLE): a refused connection, a channel
in TRANSIENT_FAILURE, a stream the worker's side cut, a gateway's served header naming a fallback. A
slow reply (a timeout) does not: one slow step is no reason to drop a worker for everyone.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from kvmesh.kv_client.router_client import KVServiceClient
from kvmesh.router.core.upstream import WorkerEndpoint

log = logging.getLogger("kvmesh.router.discovery")

QUIET_S = 1.0
"""One report per worker process this often at most (a burst of failed requests sends one)."""


class DownReports:
    """Args:
    kv: the kv_service (None: a static ``--workers`` list; only the local health mark applies).
    reporter: this front's id, for the kv_service's log.
    """

    def __init__(self, kv: KVServiceClient | None, reporter: str = "") -> None:
        self.kv = kv
        self.reporter = reporter
        self.sent = 0
        self._last: dict[tuple[str, int], float] = {}
        self._tasks: set[asyncio.Task] = set()

    def report(self, endpoint: WorkerEndpoint) -> None:
        """Call on the front's loop; returns at once (the report goes in the background)."""
        if self.kv is None:
            return
        key, now = (endpoint.worker_id, endpoint.epoch), time.monotonic()
        if now - self._last.get(key, -QUIET_S) < QUIET_S:
            return
        if len(self._last) > 4096:
            self._last = {k: t for k, t in self._last.items() if now - t < QUIET_S}
        self._last[key] = now
        task = asyncio.get_running_loop().create_task(self._send(endpoint))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send(self, endpoint: WorkerEndpoint) -> None:
        assert self.kv is not None
        try:
            left = await self.kv.leave_worker(endpoint.worker_id, endpoint.epoch, self.reporter)
        except grpc.aio.AioRpcError as exc:
            log.info("could not report worker %s unreachable: %s", endpoint.worker_id, exc.code().name)
            return
        self.sent += 1
        if left:
            log.warning("worker %s at %s unreachable: out of every front's live set", endpoint.worker_id,
                        endpoint.address)
