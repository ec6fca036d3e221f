"""Every kvmesh server: a ``grpc.aio`` server with health (NOT_SERVING until ready), reflection, the
auth and error interceptors, and a graceful stop (SIGTERM: stop accepting, drain ``grace`` seconds)."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.transport import security
from kvmesh.transport.channels import CHANNEL_OPTIONS, MAX_MESSAGE_BYTES
from kvmesh.transport.drain import DrainGate
from kvmesh.transport.interceptor import ErrorMappingInterceptor
from kvmesh.transport.reflection import enable_reflection


class AioServer:
    """A ``grpc.aio`` server with health, reflection, the auth and error interceptors and
    graceful stop. Build it on the loop that will run it."""

    def __init__(self, host: str, port: int, token_name: str = "admin token",
                 max_receive_bytes: int = MAX_MESSAGE_BYTES) -> None:
        """``max_receive_bytes``: a larger request message is RESOURCE_EXHAUSTED before it is decoded."""
        sec = security.current()
        auth = [security.BearerTokenInterceptor(sec.server_token, token_name)] if sec.server_token else []
        self.gate = DrainGate()
        options = [*CHANNEL_OPTIONS[:1], ("grpc.max_receive_message_length", max_receive_bytes)]
        self.server = grpc.aio.server(interceptors=[*auth, ErrorMappingInterceptor(self.gate)], options=options)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names: list[str] = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        self.address = f"{host}:{port}"
        if sec.server_tls.enabled:
            self.port = self.server.add_secure_port(self.address, security.server_credentials(sec.server_tls))
        else:
            self.port = self.server.add_insecure_port(self.address)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.address}: address in use or not available")
        self._stopped = False

    def add_service(self, full_name: str) -> None:
        self._service_names.append(full_name)

    async def start(self) -> None:
        enable_reflection(self.server, self._service_names)
        await self.set_serving(False)
        await self.server.start()

    async def set_serving(self, serving: bool = True) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self._service_names[2:]]:
            await self.health.set(name, status)

    async def stop(self, grace: float = 5.0) -> None:
        """NOT_SERVING; new RPCs refused with UNAVAILABLE; those in flight get up to ``grace``
        seconds to finish, then end UNAVAILABLE; then the port closes."""
        if self._stopped:
            return
        self._stopped = True
        await self.set_serving(False)
        await self.gate.drain(grace)
        # NOTE: a short grace of grpc's own, so the statuses of the RPCs the gate just ended reach
        # the wire before the connections close (else clients read "Cancelling all calls").
        await self.server.stop(0.2)

