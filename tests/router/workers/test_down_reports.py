"""router/workers/down_reports.py against a real kv_service (memory store, loopback gRPC): a front's
report takes the worker out of the live set, once per worker process a second however many requests
fail on it; a report about an earlier process changes nothing; with no kv_service it is a no-op."""

from __future__ import annotations

import asyncio

from kvmesh.contract.index_protocol import Registration
from kvmesh.kv_client.router_client import KVServiceClient
from kvmesh.kv_service.config import ServiceConfig
from kvmesh.kv_service.server import KVServiceServer
from kvmesh.kv_service.store_memory import MemoryIndex
from kvmesh.loopback import free_port
from kvmesh.router.core.upstream import WorkerEndpoint
from kvmesh.router.workers.down_reports import DownReports


def test_one_report_per_worker_process_takes_it_out():
    server = KVServiceServer(MemoryIndex(), "127.0.0.1", free_port(), ServiceConfig(lease_ttl_ms=30_000)).start()
    try:
        for wid in ("w0", "w1"):
            asyncio.run(server.service.register(Registration(wid, "127.0.0.1:1", "m", 16, "sha256_128", 64, 7)))

        async def scenario() -> tuple[int, int, set[str]]:
            kv = KVServiceClient(f"127.0.0.1:{server.port}")
            reports = DownReports(kv, "test-router")
            for _ in range(5):  # a burst of failed requests on one worker
                reports.report(WorkerEndpoint("w0", "127.0.0.1:1", epoch=7))
            reports.report(WorkerEndpoint("w1", "127.0.0.1:1", epoch=6))  # an earlier process of w1
            await asyncio.gather(*reports._tasks)
            live = {w.registration.worker_id for w in await kv.list_workers()}
            await kv.close()
            return reports.sent, int(server.service.metrics.leaves.labels("unreachable")._value.get()), live

        sent, leaves, live = asyncio.run(scenario())
        assert (sent, leaves, live) == (2, 1, {"w1"})
    finally:
        server.stop(0)


def test_no_kv_service_no_report():
    async def scenario() -> int:
        reports = DownReports(None)
        reports.report(WorkerEndpoint("w0", "127.0.0.1:1"))
        return len(reports._tasks)

    assert asyncio.run(scenario()) == 0
