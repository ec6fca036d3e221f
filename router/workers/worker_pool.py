"""The workers of one model, as discovery last saw them, and calls to them (router/core/upstream.py's
WorkerPool over worker_calls.py)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import grpc

from kvmesh.contract.block_hash import algorithm_name
from kvmesh.contract.convert import kv_source_to_pb, sampling_to_pb
from kvmesh.contract.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from kvmesh.contract.types import ModelSpec
from kvmesh.router.config import RouterConfig
from kvmesh.router.core.upstream import (
    WorkerEndpoint,
    WorkerRequest,
)
from kvmesh.router.core.worker_set import WorkerSet
from kvmesh.router.workers.down_reports import DownReports
from kvmesh.router.workers.openai_worker import OpenAIWorkerCall, is_http
from kvmesh.router.workers.worker_calls import GrpcWorkerCall, WorkerChannels
from kvmesh.transport.security import call_metadata
from kvmesh.v1 import worker_pb2 as w_pb

log = logging.getLogger("kvmesh.router.discovery")

ADAPTER_CHANGE_TIMEOUT_S = 60.0
"""A LoRA adapter's load reads and checks its files on the worker."""
_ERROR_OF = {grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument, grpc.StatusCode.NOT_FOUND: NotFound,
             grpc.StatusCode.ALREADY_EXISTS: AlreadyExists, grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition}
_HTTP_ERROR_OF = {400: InvalidArgument, 404: NotFound}

class GrpcWorkerPool:
    """The workers of one model, as :class:`WorkerDiscovery` last saw them, and calls to them.

    Args:
        model_id: the model.
        config: the router's flags (block size / hash algorithm until a worker reports them).
        channels: the router's worker channels.
        discovers_from_index: the set comes from kv_service (a Lookup may name newer workers).
    """

    def __init__(self, model_id: str, config: RouterConfig, channels: WorkerChannels,
                 discovers_from_index: bool = True, reports: DownReports | None = None) -> None:
        self.model_id = model_id
        self.reports = reports
        """Where a worker found unreachable is reported (every front drops it); None: the mark stays local."""
        self.config = config
        self.discovers_from_index = discovers_from_index
        self.workers = WorkerSet(config.routing.unhealthy_s, discovers_from_index)
        self.max_model_len = 0
        """The smallest max_model_len the static workers report (0 = unknown; kv_service discovery
        does not carry it)."""
        self._channels = channels
        self._md = call_metadata()

    # -- WorkerPool -------------------------------------------------------------------------
    @property
    def problem(self) -> str:
        return self.workers.problem

    def endpoints(self) -> list[WorkerEndpoint]:
        return self.workers.endpoints

    def model_spec(self) -> ModelSpec:
        if self.workers.spec is not None:
            return self.workers.spec
        # NOTE: no worker seen yet: hash with the flags (a static pool's workers never report an algorithm).
        return ModelSpec(self.model_id, self.config.block_size, algorithm_name(self.config.hash_algorithm))

    def healthy(self, worker_id: str) -> bool:
        return self.workers.healthy(worker_id)

    def mark_unhealthy(self, worker_id: str) -> None:
        self.workers.mark_unhealthy(worker_id)
        if self.reports is not None:
            endpoint = next((e for e in self.workers.endpoints if e.worker_id == worker_id), None)
            if endpoint is not None:
                self.reports.report(endpoint)

    def generate(self, endpoint: WorkerEndpoint, request: WorkerRequest,
                 timeout_s: float) -> GrpcWorkerCall | OpenAIWorkerCall:
        if is_http(endpoint.address):
            return OpenAIWorkerCall(self._channels.http(), endpoint, request, timeout_s)
        msg = w_pb.WorkerGenerateRequest(request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                                         sampling=sampling_to_pb(request.sampling), cache_salt=request.cache_salt,
                                         adapter=request.adapter)
        if request.prefill_leg:
            msg.kv_transfer.do_remote_decode = True
        elif request.kv_source is not None:
            msg.kv_transfer.source.CopyFrom(kv_source_to_pb(request.kv_source))
        md = (*(self._md or ()), *request.trace.headers()) if request.trace is not None else self._md
        call = self._channels.stub(endpoint.address).Generate(msg, timeout=timeout_s, metadata=md)
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

    async def change_adapter(self, endpoint: WorkerEndpoint, name: str, path: str, load: bool) -> None:
        """Loads LoRA adapter ``name`` from ``path`` on the worker (or unloads it): a kvmesh worker's
        LoadAdapter / UnloadAdapter, a bridged vLLM's /v1/load_lora_adapter / unload route (router/api/
        adapter_admin.py). Raises the worker's refusal as the matching KVMeshError (Unavailable: unreachable)."""
        if is_http(endpoint.address):
            route = "load_lora_adapter" if load else "unload_lora_adapter"
            body = {"lora_name": name, **({"lora_path": path} if load else {})}
            try:
                async with self._channels.http().post(
                        f"{endpoint.address}/v1/{route}", json=body,
                        timeout=aiohttp.ClientTimeout(total=ADAPTER_CHANGE_TIMEOUT_S)) as resp:
                    if resp.status != 200:
                        text = (await resp.text())[:300]
                        raise _HTTP_ERROR_OF.get(resp.status, FailedPrecondition)(
                            f"the engine answered {resp.status}: {text}")
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:  # noqa: UP041 - 3.10's TimeoutError
                raise Unavailable(f"the engine at {endpoint.address} is unreachable: {exc}") from None
            return
        stub = self._channels.stub(endpoint.address)
        try:
            if load:
                await stub.LoadAdapter(w_pb.LoadAdapterRequest(name=name, path=path),
                                       timeout=ADAPTER_CHANGE_TIMEOUT_S, metadata=self._md)
            else:
                await stub.UnloadAdapter(w_pb.UnloadAdapterRequest(name=name), timeout=ADAPTER_CHANGE_TIMEOUT_S,
                                         metadata=self._md)
        except grpc.aio.AioRpcError as exc:
            raise _ERROR_OF.get(exc.code(), Unavailable)(exc.details() or exc.code().name) from None

    async def release_kv(self, endpoint: WorkerEndpoint, request_id: str) -> bool:
        """Prefill/decode disaggregation: the prefill worker frees the KV it holds for ``request_id``."""
        if is_http(endpoint.address):
            return False  # NOTE: vLLM frees a prefill's blocks by its own timeout (VLLM_NIXL_ABORT_REQUEST_TIMEOUT)
        try:
            r = await self._channels.stub(endpoint.address).ReleaseKV(
                w_pb.ReleaseKVRequest(request_id=request_id), timeout=self.config.rpc_timeout_s, metadata=self._md)
        except grpc.aio.AioRpcError as exc:
            log.info("KV release of %s on worker %s failed: %s", request_id, endpoint.worker_id, exc.code().name)
            return False
        return r.released

    # -- fed by WorkerDiscovery ------------------------------------------------------------------
    def update(self, endpoints: list[WorkerEndpoint], spec: ModelSpec | None, problem: str = "") -> None:
        """The model's live workers of the last poll (``spec`` None: keep the last one)."""
        self.workers.update(endpoints, spec, problem)

    def set_problem(self, problem: str) -> None:
        """The source failed: keep the last good set, say why it may be stale."""
        self.workers.set_problem(problem)
