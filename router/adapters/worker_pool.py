"""The workers of one model, as discovery last saw them, and calls to them (router/upstream.py's
WorkerPool over worker_calls.py)."""

from __future__ import annotations

import logging
import time

import grpc

from kvmesh.contract.block_hash import algorithm_name
from kvmesh.contract.convert import sampling_to_pb
from kvmesh.contract.types import ModelSpec
from kvmesh.router.adapters.openai_worker import OpenAIWorkerCall, is_http
from kvmesh.router.adapters.worker_calls import GrpcWorkerCall, WorkerChannels
from kvmesh.router.config import RouterConfig
from kvmesh.router.upstream import (
    WorkerEndpoint,
    WorkerRequest,
)
from kvmesh.transport.security import call_metadata
from kvmesh.v1 import worker_pb2 as w_pb

log = logging.getLogger("kvmesh.router.discovery")

EMPTY_GRACE_S = 5.0
"""How long an index that suddenly lists none of the model's workers is doubted (the last set kept)."""


class GrpcWorkerPool:
    """The workers of one model, as :class:`WorkerDiscovery` last saw them, and calls to them.

    Args:
        model_id: the model.
        config: the router's flags (block size / hash algorithm until a worker reports them).
        channels: the router's worker channels.
        discovers_from_index: the set comes from kv_service (a Lookup may name newer workers).
    """

    def __init__(self, model_id: str, config: RouterConfig, channels: WorkerChannels,
                 discovers_from_index: bool = True) -> None:
        self.model_id = model_id
        self.config = config
        self.discovers_from_index = discovers_from_index
        self.problem = ""
        """Why the worker set is empty or stale (shown in UNAVAILABLE messages: no addresses)."""
        self.max_model_len = 0
        """The smallest max_model_len the static workers report (0 = unknown; kv_service discovery
        does not carry it)."""
        self._channels = channels
        self._endpoints: list[WorkerEndpoint] = []
        self._spec: ModelSpec | None = None
        self._unhealthy: dict[str, float] = {}
        self._empty_since: float | None = None
        self._md = call_metadata()

    # -- WorkerPool -------------------------------------------------------------------------
    def endpoints(self) -> list[WorkerEndpoint]:
        return self._endpoints

    def model_spec(self) -> ModelSpec:
        if self._spec is not None:
            return self._spec
        # NOTE: no worker seen yet: hash with the flags (a static pool's workers never report an algorithm).
        return ModelSpec(self.model_id, self.config.block_size, algorithm_name(self.config.hash_algorithm))

    def healthy(self, worker_id: str) -> bool:
        until = self._unhealthy.get(worker_id)
        return until is None or time.monotonic() >= until

    def mark_unhealthy(self, worker_id: str) -> None:
        self._unhealthy[worker_id] = time.monotonic() + self.config.unhealthy_s

    def generate(self, endpoint: WorkerEndpoint, request: WorkerRequest,
                 timeout_s: float) -> GrpcWorkerCall | OpenAIWorkerCall:
        if is_http(endpoint.address):
            return OpenAIWorkerCall(self._channels.http(), endpoint, request, timeout_s)
        call = self._channels.stub(endpoint.address).Generate(
            w_pb.WorkerGenerateRequest(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                                       sampling=sampling_to_pb(request.sampling), cache_salt=request.cache_salt),
            timeout=timeout_s, metadata=self._md)
        return GrpcWorkerCall(call, endpoint)

    async def abort(self, endpoint: WorkerEndpoint, request_id: str) -> bool:
        if is_http(endpoint.address):
            return False  # NOTE: closing the call is the abort; its usage is not awaited
        try:
            r = await self._channels.stub(endpoint.address).Abort(
                w_pb.AbortRequest(request_id=request_id), timeout=self.config.rpc_timeout_s, metadata=self._md)
        except grpc.aio.AioRpcError as exc:
            log.info("abort of %s on worker %s failed: %s", request_id, endpoint.worker_id, exc.code().name)
            return False
        return r.aborted

    # -- fed by WorkerDiscovery ------------------------------------------------------------------
    def update(self, endpoints: list[WorkerEndpoint], spec: ModelSpec | None, problem: str = "") -> None:
        """The model's live workers of the last poll (``spec`` None: keep the last one)."""
        if spec is not None:
            self._spec = spec
        self.problem = problem
        if not endpoints and self._endpoints and self.discovers_from_index:
            # NOTE: a Redis that restarted empty lists no worker until each one's next heartbeat
            # gets NOT_FOUND and it registers again (a third of a lease). Dropping every worker at
            # once would fail every request in that window; a worker that really died fails its
            # requests as UNAVAILABLE (retried elsewhere) either way.
            now = time.monotonic()
            self._empty_since = self._empty_since or now
            if now - self._empty_since < EMPTY_GRACE_S:
                return
        self._empty_since = None
        # NOTE: replaced, never mutated: a request that read the list keeps a consistent one.
        self._endpoints = endpoints

    def set_problem(self, problem: str) -> None:
        """The source failed: keep the last good set, say why it may be stale."""
        self.problem = problem
