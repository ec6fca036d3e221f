"""gRPC adapter of the router (GenerateRequest in, the Frontend, GenerateResponses out) and the router
process: gRPC server, the OpenAI HTTP server, worker discovery, one event loop."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any, TypeVar

import grpc
from google.protobuf import json_format

from kvmesh.contract.convert import FINISH_TO_PB, sampling_from_pb, usage_to_pb
from kvmesh.contract.errors import InvalidArgument
from kvmesh.contract.limits import MAX_STOP_TOKEN_IDS
from kvmesh.router.config import RouterConfig
from kvmesh.router.discovery import GrpcWorkerPool, KVServiceClient, WorkerChannels, WorkerDiscovery
from kvmesh.router.frontend import Frontend
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.models import ModelSet, ServedModel
from kvmesh.router.openai_api import HttpServer
from kvmesh.router.prompt import check_message_count
from kvmesh.router.router import ChatInput, GenerateInput, Router
from kvmesh.router.stop_strings import MAX_STOP_STRINGS
from kvmesh.transport.rpc import AioServer, LoopThread
from kvmesh.v1 import router_pb2 as pb
from kvmesh.v1 import router_pb2_grpc as pb_grpc

log = logging.getLogger("kvmesh.router")

T = TypeVar("T")

MAX_TEMPLATE_KWARGS_BYTES = 64 * 1024
"""Serialized size of a chat request's chat_template_kwargs (the HTTP API bounds its JSON values)."""

REQUEST_ID_KEY = "kvmesh-request-id"
"""Trailing metadata of every Generate call that got an id (success or error): the id the request
has in the router's and the worker's logs."""


def input_from_pb(request: pb.GenerateRequest, context: grpc.aio.ServicerContext,
                  config: RouterConfig) -> GenerateInput:
    """The request as the request path takes it. Every repeated field is counted against its bound
    before anything is made of its elements (a million messages cost a length check, not a million dicts)."""
    which = request.WhichOneof("input")
    remaining = context.time_remaining()
    if len(request.stop) > MAX_STOP_STRINGS:
        raise InvalidArgument(f"stop has {len(request.stop)} strings; at most {MAX_STOP_STRINGS}", param="stop")
    if len(request.sampling.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(f"stop_token_ids has {len(request.sampling.stop_token_ids)} ids; at most "
                              f"{MAX_STOP_TOKEN_IDS}", param="stop_token_ids")
    chat = None
    if which == "chat":
        c = request.chat
        check_message_count(len(c.messages), config.max_messages)
        if c.HasField("chat_template_kwargs") and c.chat_template_kwargs.ByteSize() > MAX_TEMPLATE_KWARGS_BYTES:
            raise InvalidArgument(f"chat_template_kwargs is over {MAX_TEMPLATE_KWARGS_BYTES} bytes",
                                  param="chat_template_kwargs")
        chat = ChatInput(
            messages=[{"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
                      for m in c.messages],
            add_generation_prompt=c.add_generation_prompt if c.HasField("add_generation_prompt") else True,
            continue_final_message=c.continue_final_message,
            template_kwargs=json_format.MessageToDict(c.chat_template_kwargs) if c.HasField("chat_template_kwargs")
            else {},
        )
    return GenerateInput(
        text=request.text if which == "text" else None,
        token_ids=request.token_ids.ids if which == "token_ids" else None,
        sampling=sampling_from_pb(request.sampling),  # ValueError -> INVALID_ARGUMENT with its message
        cache_salt=request.cache_salt,
        request_id=request.request_id,
        timeout_s=None if remaining is None else max(0.0, remaining),
        chat=chat,
        stop=list(request.stop),
        include_stop_str_in_output=request.include_stop_str_in_output,
    )


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, frontend: Frontend, config: RouterConfig) -> None:
        self.frontend = frontend
        self.config = config

    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        model = self.frontend.model(request.model)
        inp = input_from_pb(request, context, self.config)
        rid = model.router.request_id_for(inp)
        context.set_trailing_metadata(((REQUEST_ID_KEY, rid),))
        async for out in self.frontend.generate(model, inp, rid):
            msg = pb.GenerateResponse(token_ids=out.token_ids, text=out.text, request_id=out.request_id)
            if out.finish_reason is not None:
                msg.finish_reason = FINISH_TO_PB[out.finish_reason]
                msg.served_by = out.served_by
                if out.usage is not None:
                    msg.usage.CopyFrom(usage_to_pb(out.usage))
            yield msg

    async def ListModels(self, request: pb.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> pb.ListModelsResponse:
        models = self.frontend.models
        default = models.default()
        return pb.ListModelsResponse(
            models=[pb.ModelInfo(id=m.model_id, workers=len(m.pool.endpoints()), tokenizer=m.files is not None,
                                 chat_template=m.files is not None and m.files.chat_template is not None)
                    for m in models.all()],
            default_model=default.model_id if default is not None else "")


class RouterServer:
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

    async def _build(self) -> None:
        config = self.config
        # NOTE: aio channels belong to the loop they are made on: everything is built here.
        self.kv = (KVServiceClient(config.kv_service, config.lookup_timeout_ms / 1000, config.rpc_timeout_s)
                   if config.kv_service else None)
        channels = WorkerChannels()
        from_index = not config.workers
        self.models = ModelSet(config, lambda model_id: GrpcWorkerPool(model_id, config, channels, from_index),
                               self.kv, self.metrics)
        self.discovery = WorkerDiscovery(config, self.kv, channels, self.models.pool_for, self.models.pools,
                                         on_change=self._on_workers)
        self.frontend = Frontend(self.models, config.max_streams, self.metrics)
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
    def router(self) -> Router:
        """The default model's request path."""
        return self.default_model.router

    @property
    def pool(self):
        """The default model's worker pool."""
        return self.default_model.pool

    async def _on_workers(self, any_worker: bool) -> None:
        if self._started:
            await self.grpc.set_serving(any_worker)

    async def _start(self) -> None:
        await self.grpc.start()
        if self.http is not None:
            await self.http.start()
        self._started = True
        await self.discovery.start()  # first poll sets health

    def start(self) -> RouterServer:
        self._loop.run(self._start())
        return self

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Runs a coroutine on the router's loop and returns its result (tests, benchmarks)."""
        return self._loop.run(coro)

    async def _stop(self, grace: float) -> None:
        self._started = False
        # NOTE: both servers drain at once, so a stop takes `grace`, not twice it.
        await asyncio.gather(self.grpc.stop(grace), *([self.http.stop(grace)] if self.http is not None else []))
        await self.discovery.stop()
        for served in self.models.all():
            served.router.close()

    def stop(self, grace: float = 2.0) -> None:
        """Drains open streams for up to ``grace`` seconds, then closes channels and the loop."""
        if not self._loop.running:
            return
        self._loop.run(self._stop(grace))
        self._loop.stop()
