"""gRPC adapter of the router: GenerateRequest in, Router.generate, GenerateResponses out."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import grpc

from kvmesh.contract.convert import FINISH_TO_PB, sampling_from_pb, usage_to_pb
from kvmesh.contract.modelinfo import load_tokenizer, model_id_for
from kvmesh.router import metrics
from kvmesh.router.config import RouterConfig
from kvmesh.router.discovery import GrpcWorkerPool, KVServiceClient
from kvmesh.router.router import CancelScope, GenerateInput, Router
from kvmesh.transport.rpc import GrpcServer
from kvmesh.v1 import router_pb2 as pb
from kvmesh.v1 import router_pb2_grpc as pb_grpc

log = logging.getLogger("kvmesh.router")


def input_from_pb(request: pb.GenerateRequest, context: grpc.ServicerContext) -> GenerateInput:
    which = request.WhichOneof("input")
    remaining = context.time_remaining()
    return GenerateInput(
        text=request.text if which == "text" else None,
        token_ids=list(request.token_ids.ids) if which == "token_ids" else None,
        sampling=sampling_from_pb(request.sampling),  # ValueError -> INVALID_ARGUMENT with its message
        cache_salt=request.cache_salt,
        request_id=request.request_id,
        timeout_s=None if remaining is None else max(0.0, remaining),
    )


class RouterServicer(pb_grpc.RouterServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    def Generate(self, request: pb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[pb.GenerateResponse]:
        scope = CancelScope()
        context.add_callback(scope.cancel)  # NOTE: runs when the RPC ends for any reason, incl. client cancel
        metrics.INFLIGHT.inc()
        outcome = "error"
        try:
            for out in self.router.generate(input_from_pb(request, context), scope):
                msg = pb.GenerateResponse(token_ids=out.token_ids, text=out.text)
                if out.finish_reason is not None:
                    msg.finish_reason = FINISH_TO_PB[out.finish_reason]
                    msg.served_by = out.served_by
                    if out.usage is not None:
                        msg.usage.CopyFrom(usage_to_pb(out.usage))
                    outcome = "ok"
                yield msg
            if scope.cancelled and outcome != "ok":
                outcome = "cancelled"
        finally:
            metrics.INFLIGHT.dec()
            metrics.REQUESTS.labels(outcome).inc()


class RouterServer:
    """The router process: gRPC server, worker discovery, the request path.

    ``RouterServer(config).start()`` serves on ``.port``; ``.stop()`` drains and closes. Health turns
    SERVING while at least one worker is known.
    """

    def __init__(self, config: RouterConfig) -> None:
        config.check()
        self.config = config
        tokenizer = None
        if config.model_dir:
            tokenizer = load_tokenizer(config.model_dir)
            config.model_id = model_id_for(config.model_dir, config.model_id)
        self.kv = (KVServiceClient(config.kv_service, config.lookup_timeout_ms / 1000, config.index_retry_s,
                                   config.rpc_timeout_s) if config.kv_service else None)
        # NOTE: a few threads beyond max_streams keep health checks answered at the limit.
        self.grpc = GrpcServer(config.host, config.port, max_workers=config.max_streams + 8,
                               max_concurrent_rpcs=config.max_streams, token_name="api token")
        self.pool = GrpcWorkerPool(config, self.kv, on_change=self._on_workers)
        self.router = Router(config, self.pool, self.kv, tokenizer)
        pb_grpc.add_RouterServicer_to_server(RouterServicer(self.router), self.grpc.server)
        self.grpc.add_service(pb.DESCRIPTOR.services_by_name["Router"].full_name)
        self.port = self.grpc.port
        self._started = False

    def _on_workers(self, any_worker: bool) -> None:
        if self._started:
            self.grpc.set_serving(any_worker)

    def start(self) -> RouterServer:
        self.grpc.start()
        self._started = True
        self.pool.start()  # first poll sets health
        return self

    def stop(self, grace: float = 2.0) -> None:
        self._started = False
        self.grpc.stop(grace)
        self.pool.stop()
