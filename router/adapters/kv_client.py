"""The router's kv_service client: Lookup with a short deadline, ListWorkers for discovery.

The one place the router reads the status codes of kv_service calls: a failed Lookup becomes
router/upstream.py's IndexUnavailable.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc

from kvmesh.contract.convert import load_from_pb, pending_from_pb
from kvmesh.contract.types import NO_PENDING
from kvmesh.router.upstream import (
    Claim,
    ClaimAnswer,
    IndexMatch,
    IndexUnavailable,
)
from kvmesh.transport.channels import dial_aio
from kvmesh.transport.security import call_metadata
from kvmesh.v1 import kv_service_pb2 as kv_pb
from kvmesh.v1 import kv_service_pb2_grpc as kv_grpc

log = logging.getLogger("kvmesh.router.discovery")


class KVServiceClient:
    """Lookup with a short deadline; a failure raises IndexUnavailable (router/core.py's breaker then
    skips the index for a while). Build it on the loop that uses it.

    NOTE: a Lookup answer names every live worker with its load; reading 64 nested load messages
    field by field cost ~0.3 ms a request. An answer's entry (worker, address, matched blocks,
    load) repeats until the worker's next heartbeat or a different prompt, so each entry's
    IndexMatch is cached by its wire bytes (~0.4 us to get, against ~5 us to build).
    """

    MAX_CACHED = 16_384

    def __init__(self, target: str, lookup_timeout_s: float = 0.05, rpc_timeout_s: float = 2.0) -> None:
        self.target = target
        self.lookup_timeout_s = lookup_timeout_s
        self.rpc_timeout_s = rpc_timeout_s
        self._channel = dial_aio(target)
        self._stub = kv_grpc.KVServiceStub(self._channel)
        self._md = call_metadata()
        self._matches: dict[bytes, IndexMatch] = {}

    def _match(self, m: kv_pb.WorkerMatch) -> IndexMatch:
        key = m.SerializeToString()
        found = self._matches.get(key)
        if found is None:
            if len(self._matches) >= self.MAX_CACHED:
                self._matches.clear()
            pending = pending_from_pb(m.pending) if m.HasField("pending") else NO_PENDING
            found = self._matches[key] = IndexMatch(m.worker_id, m.address, m.matched_blocks, load_from_pb(m.load),
                                                    pending)
        return found

    async def lookup(self, model_id: str, block_hashes: Sequence[bytes]) -> list[IndexMatch]:
        try:
            answer = await self._stub.Lookup(kv_pb.LookupRequest(model_id=model_id, block_hashes=block_hashes),
                                             timeout=self.lookup_timeout_s, metadata=self._md)
        except grpc.aio.AioRpcError as exc:
            # NOTE: INVALID_ARGUMENT is about this Lookup, not the index being down: the breaker
            # must not open for every client because of one request (router/core.py).
            cause = "lookup_invalid" if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else "lookup_failed"
            raise IndexUnavailable(f"kv_service at {self.target}: {exc.code().name}: {exc.details()}", cause) from None
        return [self._match(m) for m in answer.workers]

    async def reserve(self, model_id: str, router_id: str, claim: Claim) -> ClaimAnswer:
        try:
            answer = await self._stub.Reserve(kv_pb.ReserveRequest(
                model_id=model_id, worker_id=claim.worker_id, router_id=router_id, request_id=claim.request_id,
                prefill_tokens=claim.prefill_tokens, blocks=claim.blocks, seen_version=claim.seen_version),
                timeout=self.lookup_timeout_s, metadata=self._md)
        except grpc.aio.AioRpcError as exc:
            raise IndexUnavailable(f"kv_service at {self.target}: Reserve: {exc.code().name}: {exc.details()}",
                                   "reserve_failed") from None
        return ClaimAnswer(answer.reserved, {w.worker_id: pending_from_pb(w.pending) for w in answer.workers})

    async def list_workers(self) -> list[kv_pb.WorkerInfo]:
        """Live workers of every model; raises grpc.aio.AioRpcError."""
        resp = await self._stub.ListWorkers(kv_pb.ListWorkersRequest(), timeout=self.rpc_timeout_s, metadata=self._md)
        return list(resp.workers)

    async def close(self) -> None:
        await self._channel.close()
