"""The router process: the gRPC server (api/grpc_api.py), the OpenAI HTTP server
(api/openai_api.py) and worker discovery (workers/discovery.py), on one event loop."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Coroutine
from typing import Any, TypeVar

import grpc

from kvmesh.contract.index_protocol import WorkerAudit
from kvmesh.kv_client.router_client import KVServiceClient
from kvmesh.router.api.frontend import Frontend
from kvmesh.router.api.grpc_api import RouterServicer
from kvmesh.router.api.openai_api import HttpServer
from kvmesh.router.config import RouterConfig
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.model_router import ModelRouter
from kvmesh.router.models import ModelSet, ServedModel
from kvmesh.router.workers.discovery import WorkerDiscovery
from kvmesh.router.workers.down_reports import DownReports
from kvmesh.router.workers.worker_calls import WorkerChannels
from kvmesh.router.workers.worker_pool import GrpcWorkerPool
from kvmesh.transport.loop import LoopServer, LoopThread
from kvmesh.transport.server import AioServer
from kvmesh.v1 import router_pb2 as pb
from kvmesh.v1 import router_pb2_grpc as pb_grpc

log = logging.getLogger("kvmesh.router")

T = TypeVar("T")

MAX_HELD_AUDITS = 4096
"""Workers whose audit counts a router keeps while the kv_service does not take its reports; past it they go."""


class RouterServer(LoopServer):
    """The router process: a grpc.aio server (and, with ``http_port``, the OpenAI HTTP server),
    worker discovery and every model's request path, on one event loop of their own (``start``/
    ``stop`` are called from any other thread).

    ``RouterServer(config).start()`` serves on ``.port`` (and ``.http_port``); ``.stop()`` drains
    and closes. Health turns SERVING while at least one worker of any model is known. ``metrics``
    holds this server's Prometheus registry.
    """

    def __init__(self, config: RouterConfig) -> None:
        config.check()
        self.config = config
        self.metrics = RouterMetrics()
        self._loop = LoopThread("router")
        try:
            self._loop.run(self._build())
        except BaseException:
            self._loop.stop()
            raise
        self.port = self.grpc.port
        self.http_port = self.http.port if self.http is not None else None
        self._started = False
        self._audits: asyncio.Task | None = None
        self.router_id = f"router-{uuid.uuid4().hex[:12]}"
        self.down_reports.reporter = self.router_id

    async def _build(self) -> None:
        config = self.config
        # NOTE: aio channels belong to the loop they are made on: everything is built here.
        self.kv = (KVServiceClient(config.kv_service, config.routing.lookup_timeout_ms / 1000, config.rpc_timeout_s)
                   if config.kv_service else None)
        channels = WorkerChannels(self._channel_down)
        from_index = not config.workers
        self.down_reports = DownReports(self.kv if from_index else None)
        self.models = ModelSet(config, lambda model_id: GrpcWorkerPool(model_id, config, channels, from_index,
                                                                       self.down_reports),
                               self.kv, self.metrics)
        self.discovery = WorkerDiscovery(config, self.kv, channels, self.models.pool_for, self.models.pools,
                                         on_change=self._on_workers)
        self.frontend = Frontend(self.models, config.max_streams, self.metrics)
        self._fronts()

    def _fronts(self) -> None:
        """The doors requests come in by: the Router gRPC service and, with ``http_port``, the OpenAI HTTP API
        (router/epp.py's EppServer has the ext_proc one instead)."""
        config = self.config
        self.grpc = AioServer(config.host, config.port, token_name="api token", max_receive_bytes=config.max_body_bytes)
        pb_grpc.add_RouterServicer_to_server(RouterServicer(self.frontend, config), self.grpc.server)
        self.grpc.add_service(pb.DESCRIPTOR.services_by_name["Router"].full_name)
        self.http = (HttpServer(self.frontend, config.host, config.http_port, config) if config.http_port is not None
                     else None)

    @property
    def default_model(self) -> ServedModel:
        """The model a request that names none gets (tests, benchmarks of a one-model router)."""
        served = self.models.default()
        if served is None:
            raise LookupError("this router has no default model (several or none are served)")
        return served

    @property
    def router(self) -> ModelRouter:
        """The default model's request path."""
        return self.default_model.router

    @property
    def pool(self):
        """The default model's worker pool."""
        return self.default_model.pool

    def _channel_down(self, address: str) -> None:
        """A worker's channel went to TRANSIENT_FAILURE: the worker at that address is marked down (and
        reported, router/workers/down_reports.py) in whichever pool has it."""
        for served in self.models.all():
            for endpoint in served.pool.endpoints():
                if endpoint.address == address:
                    served.pool.mark_unhealthy(endpoint.worker_id)

    async def _on_workers(self, any_worker: bool) -> None:
        if self._started:
            await self.grpc.set_serving(any_worker)

    async def _start(self) -> None:
        await self.grpc.start()
        if self.http is not None:
            await self.http.start()
        self._started = True
        await self.discovery.start()  # first poll sets health
        if self.kv is not None:
            self._audits = asyncio.get_running_loop().create_task(self._report_audits())

    async def _report_audits(self) -> None:
        """Every discovery interval, each model's miss-audit counts since the last report go to the
        kv_service (``kvmesh admin audit`` reads them there); counts a failed report held go with the next."""
        assert self.kv is not None
        held: dict[str, WorkerAudit] = {}
        while True:
            await asyncio.sleep(self.config.routing.discovery_interval_s)
            for served in self.models.all():
                audit = served.router.audit
                for worker_id, a in audit.take().items():
                    held.setdefault(worker_id, WorkerAudit()).add(a)
                audit.forget({e.worker_id for e in served.pool.endpoints()})
            if not held:
                continue
            try:
                await self.kv.report_audit(self.router_id, held)
                held = {}
            except grpc.aio.AioRpcError as exc:
                log.debug("miss audit report to the kv_service failed (%s); kept for the next", exc.code().name)
                if len(held) > MAX_HELD_AUDITS:
                    held = {}

    def start(self) -> RouterServer:
        self._loop.run(self._start())
        return self

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs a coroutine on the router's loop and returns its result (tests, benchmarks)."""
        return self._loop.run(coro)

    async def _stop(self, grace: float) -> None:
        self._started = False
        if self._audits is not None:
            self._audits.cancel()
        # NOTE: both servers drain at once, so a stop takes `grace`, not twice it.
        await asyncio.gather(self.grpc.stop(grace), *([self.http.stop(grace)] if self.http is not None else []))
        await self.discovery.stop()
        for served in self.models.all():
            served.router.close()
