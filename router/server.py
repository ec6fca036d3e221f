"""gRPC adapter of the router: GenerateRequest in, Router.generate, GenerateResponses out."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import grpc

from kvmesh.contract.convert import FINISH_TO_PB, sampling_from_pb, usage_to_pb
from kvmesh.contract.errors import ResourceExhausted
from kvmesh.contract.modelinfo import context_length, load_tokenizer, model_id_for
from kvmesh.router.config import RouterConfig
from kvmesh.router.discovery import GrpcWorkerPool, KVServiceClient
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.router import GenerateInput, Router
from kvmesh.transport.rpc import AioServer, LoopThread
from kvmesh.v1 import router_pb2 as pb
from kvmesh.v1 import router_pb2_grpc as pb_grpc

log = logging.getLogger("kvmesh.router")

T = TypeVar("T")

REQUEST_ID_KEY = "kvmesh-request-id"
"""Trailing metadata of every Generate call that got an id (success or error): the id the request
has in the router's and the worker's logs."""


def input_from_pb(request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> GenerateInput:
    which = request.WhichOneof("input")
    remaining = context.time_remaining()
    return GenerateInput(
        text=request.text if which == "text" else None,
        token_ids=request.token_ids.ids if which == "token_ids" else None,
        sampling=sampling_from_pb(request.sampling),  # ValueError -> INVALID_ARGUMENT with its message
        cache_salt=request.cache_salt,
        request_id=request.request_id,
        timeout_s=None if remaining is None else max(0.0, remaining),
    )


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, router: Router, max_streams: int) -> None:
        self.router = router
        self.max_streams = max_streams
        self.streams = 0
        """Generate streams open now (a stream is a coroutine on the loop, not a thread)."""

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        m = self.router.metrics
        if self.streams >= self.max_streams:
            m.refused.inc()
            raise ResourceExhausted(f"this router has {self.max_streams} streams open (--max-streams); "
                                    "retry later or on another router")
        inp = input_from_pb(request, context)
        rid = self.router.request_id_for(inp)
        context.set_trailing_metadata(((REQUEST_ID_KEY, rid),))
        self.streams += 1
        m.inflight.inc()
        outcome = "error"
        try:
            async for out in self.router.generate(inp, rid):
                msg = pb.GenerateResponse(token_ids=out.token_ids, text=out.text, request_id=out.request_id)
                if out.finish_reason is not None:
                    msg.finish_reason = FINISH_TO_PB[out.finish_reason]
                    msg.served_by = out.served_by
                    if out.usage is not None:
                        msg.usage.CopyFrom(usage_to_pb(out.usage))
                    outcome = "ok"
                yield msg
        except asyncio.CancelledError:
            if outcome != "ok":
                outcome = "cancelled"  # the client went away (or the call's deadline passed)
            raise
        finally:
            self.streams -= 1
            m.inflight.dec()
            m.requests.labels(outcome).inc()


class RouterServer:
    """The router process: a grpc.aio server, worker discovery and the request path, on one event
    loop of their own (``start``/``stop`` are called from any other thread).

    ``RouterServer(config).start()`` serves on ``.port``; ``.stop()`` drains and closes. Health turns
    SERVING while at least one worker is known. ``metrics`` holds this server's Prometheus registry.
    """

    def __init__(self, config: RouterConfig) -> None:
        config.check()
        self.config = config
        self.tokenizer = None
        self.context_len: int | None = None
        if config.model_dir:
            self.tokenizer = load_tokenizer(config.model_dir)
            config.model_id = model_id_for(config.model_dir, config.model_id)
            self.context_len = context_length(config.model_dir)
        self.metrics = RouterMetrics()
        self._loop = LoopThread("router")
        self._loop.run(self._build())
        self.port = self.grpc.port
        self._started = False

    async def _build(self) -> None:
        config = self.config
        # NOTE: aio channels belong to the loop they are made on: everything is built here.
        self.kv = (KVServiceClient(config.kv_service, config.lookup_timeout_ms / 1000, config.rpc_timeout_s)
                   if config.kv_service else None)
        self.grpc = AioServer(config.host, config.port, token_name="api token")
        self.pool = GrpcWorkerPool(config, self.kv, on_change=self._on_workers)
        self.router = Router(config, self.pool, self.kv, self.tokenizer, metrics=self.metrics,
                             context_len=self.context_len)
        self.servicer = RouterServicer(self.router, config.max_streams)
        pb_grpc.add_RouterServicer_to_server(self.servicer, self.grpc.server)
        self.grpc.add_service(pb.DESCRIPTOR.services_by_name["Router"].full_name)

    async def _on_workers(self, any_worker: bool) -> None:
        if self._started:
            await self.grpc.set_serving(any_worker)

    async def _start(self) -> None:
        await self.grpc.start()
        self._started = True
        await self.pool.start()  # first poll sets health

    def start(self) -> RouterServer:
        self._loop.run(self._start())
        return self

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs a coroutine on the router's loop and returns its result (tests, benchmarks)."""
        return self._loop.run(coro)

    async def _stop(self, grace: float) -> None:
        self._started = False
        await self.grpc.stop(grace)
        await self.pool.stop()
        self.router.close()

    def stop(self, grace: float = 2.0) -> None:
        """Drains open streams for up to ``grace`` seconds, then closes channels and the loop."""
        if not self._loop.running:
            return
        self._loop.run(self._stop(grace))
        self._loop.stop()
