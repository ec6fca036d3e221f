"""`kvmesh epp`: the router's decisions behind a gateway, as the Gateway API Inference Extension's
endpoint picker (docs/epp.md).

The same process as ``kvmesh router`` (router/server.py: discovery, every model's request path, the
kv_service client, the miss audit's reports), with one front door: Envoy's ext_proc v3
(router/api/ext_proc.py) instead of the Router service and the OpenAI HTTP API. A request's pick is
the router's own (``ModelRouter.decide``): a second front, not a copy.

Health (the protocol's): ``liveness`` is SERVING once the server runs; ``readiness``, the ext_proc
service's name and the overall status are SERVING while discovery knows a worker.
"""

from __future__ import annotations

import logging

from grpc_health.v1 import health_pb2

from kvmesh.router.api.ext_proc import SERVICE_NAME, add_to_server, max_receive_bytes
from kvmesh.router.config import EppConfig, RouterConfig
from kvmesh.router.server import RouterServer
from kvmesh.transport.server import AioServer

log = logging.getLogger("kvmesh.epp")

LIVENESS = "liveness"
READINESS = "readiness"
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EppServer(RouterServer):
    """``EppServer(config, epp).start()`` serves ext_proc (and grpc health) on ``.port``; ``.stop()`` drains."""

    def __init__(self, config: RouterConfig, epp: EppConfig) -> None:
        epp.check()
        self.epp = epp
        super().__init__(config)

    def _fronts(self) -> None:
        config, epp = self.config, self.epp
        self.grpc = AioServer(config.host, epp.port, token_name="api token",
                              max_receive_bytes=max_receive_bytes(config.max_body_bytes))
        add_to_server(self.grpc.server, self.frontend, config, epp)
        self.grpc.add_service(SERVICE_NAME)
        self.http = None

    async def _start(self) -> None:
        await self.grpc.health.set(LIVENESS, _SERVING)
        await self.grpc.health.set(READINESS, _NOT_SERVING)
        await super()._start()

    async def _on_workers(self, any_worker: bool) -> None:
        await super()._on_workers(any_worker)
        if self._started:
            await self.grpc.health.set(READINESS, _SERVING if any_worker else _NOT_SERVING)

    async def _stop(self, grace: float) -> None:
        await self.grpc.health.set(READINESS, _NOT_SERVING)
        await super()._stop(grace)
