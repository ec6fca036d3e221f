"""The router's kv_service client: Lookup and Reserve with a short deadline, ListWorkers for discovery.

The one place the router's calls to the kv_service read gRPC status codes: a failed Lookup or
Reserve becomes kvmesh/contract/index_protocol.py's IndexUnavailable. It implements
router/core/upstream.py's ``AsyncPrefixIndex``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence

import grpc

from kvmesh.contract.convert import (
    audit_to_pb,
    match_from_pb,
    reservation_answer_from_pb,
    reservation_to_pb,
    worker_info_from_pb,
)
from kvmesh.contract.index_protocol import (
    IndexUnavailable,
    Reservation,
    ReservationAnswer,
    WorkerAudit,
    WorkerInfo,
    WorkerMatch,
)
from kvmesh.transport import tracing
from kvmesh.transport.channels import dial_aio
from kvmesh.transport.security import call_metadata
from kvmesh.v1 import kv_service_pb2 as kv_pb
from kvmesh.v1 import kv_service_pb2_grpc as kv_grpc

log = logging.getLogger("kvmesh.router.kv_client")


def now_ms() -> int:
    return int(time.time() * 1000)


class KVServiceClient:
    """Lookup with a short deadline; a failure raises IndexUnavailable (router/core/routing.py's breaker then
    skips the index for a while). Build it on the loop that uses it.

    NOTE: a Lookup answer names every live worker with its load; reading 64 nested load messages
    field by field cost ~0.3 ms a request. An answer's entry (worker, address, matched blocks,
    load) repeats until the worker's next heartbeat or a different prompt, so each entry's
    WorkerMatch is cached by its wire bytes (~0.4 us to get, against ~5 us to build).
    """

    MAX_CACHED = 16_384

    def __init__(self, target: str, lookup_timeout_s: float = 0.05, rpc_timeout_s: float = 2.0) -> None:
        self.target = target
        self.lookup_timeout_s = lookup_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self._channel = dial_aio(target)
        self._stub = kv_grpc.KVServiceStub(self._channel)
        self._md = call_metadata()
        self._matches: dict[bytes, WorkerMatch] = {}

    def _match(self, m: kv_pb.WorkerMatch) -> WorkerMatch:
        key = m.SerializeToString()
        found = self._matches.get(key)
        if found is None:
            if len(self._matches) >= self.MAX_CACHED:
                self._matches.clear()
            found = self._matches[key] = match_from_pb(m)
        return found

    async def lookup(self, model_id: str, block_hashes: Sequence[bytes]) -> list[WorkerMatch]:
        return (await self._lookup(kv_pb.LookupRequest(model_id=model_id, block_hashes=block_hashes)))[0]

    async def lookup_reserve(self, model_id: str, block_hashes: Sequence[bytes],
                             reservation: Reservation) -> tuple[list[WorkerMatch], bool]:
        """The Lookup with the Reserve folded in (one round trip): (the answer, reserved)."""
        return await self._lookup(kv_pb.LookupRequest(model_id=model_id, block_hashes=block_hashes,
                                                      reserve=reservation_to_pb(reservation)))

    async def _lookup(self, request: kv_pb.LookupRequest) -> tuple[list[WorkerMatch], bool]:
        try:
            answer = await self._stub.Lookup(request, timeout=self.lookup_timeout_s,
                                             metadata=tracing.grpc_metadata(self._md))
        except grpc.aio.AioRpcError as exc:
            # NOTE: INVALID_ARGUMENT is about this Lookup, not the index being down: the breaker
            # must not open for every client because of one request (router/core/routing.py).
            cause = "lookup_invalid" if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else "lookup_failed"
            raise IndexUnavailable(f"kv_service at {self.target}: {exc.code().name}: {exc.details()}", cause,
                                   exc.code().value[0]) from None
        return [self._match(m) for m in answer.workers], answer.reserved

    async def reserve(self, reservation: Reservation) -> ReservationAnswer:
        try:
            answer = await self._stub.Reserve(reservation_to_pb(reservation), timeout=self.lookup_timeout_s,
                                              metadata=tracing.grpc_metadata(self._md))
        except grpc.aio.AioRpcError as exc:
            raise IndexUnavailable(f"kv_service at {self.target}: Reserve: {exc.code().name}: {exc.details()}",
                                   "reserve_failed", exc.code().value[0]) from None
        return reservation_answer_from_pb(answer)

    async def report_audit(self, router_id: str, audits: dict[str, WorkerAudit]) -> None:
        """The miss audit's counts since the last report (router/core/audit.py); raises grpc.aio.AioRpcError."""
        await self._stub.ReportAudit(kv_pb.ReportAuditRequest(
            router_id=router_id, workers=[audit_to_pb(w, a) for w, a in audits.items()]),
            timeout=self.rpc_timeout_s, metadata=self._md)

    async def list_workers(self) -> list[WorkerInfo]:
        """Registered workers of every model (live ones unless ``include_expired``); raises grpc.aio.AioRpcError."""
        resp = await self._stub.ListWorkers(kv_pb.ListWorkersRequest(), timeout=self.rpc_timeout_s, metadata=self._md)
        now = now_ms()
        return [worker_info_from_pb(w, now) for w in resp.workers]

    async def watch_workers(self) -> AsyncIterator[list[WorkerInfo]]:
        """Push discovery: the live workers now, then at every change (WatchWorkers); raises
        grpc.aio.AioRpcError when the stream breaks."""
        call = self._stub.WatchWorkers(kv_pb.WatchWorkersRequest(), metadata=self._md)
        try:
            async for resp in call:
                now = now_ms()
                yield [worker_info_from_pb(w, now) for w in resp.workers]
        finally:
            call.cancel()

    async def leave_worker(self, worker_id: str, epoch: int, reporter: str) -> bool:
        """Says ``worker_id`` is unreachable: it leaves every front's live set (LeaveWorker); raises
        grpc.aio.AioRpcError."""
        resp = await self._stub.LeaveWorker(kv_pb.LeaveWorkerRequest(
            worker_id=worker_id, epoch=epoch, reason=kv_pb.LEAVE_REASON_UNREACHABLE, reporter=reporter),
            timeout=self.rpc_timeout_s, metadata=self._md)
        return resp.left

    async def close(self) -> None:
        await self._channel.close()
