"""gRPC plumbing shared by every server and client: the one place errors become status codes.

Health (grpc.health.v1) starts NOT_SERVING and turns SERVING when the server is ready;
reflection is on; SIGTERM stops accepting, drains for ``grace`` seconds, then exits.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.contract import errors
from kvmesh.transport import security

log = logging.getLogger("kvmesh.transport.rpc")

STATUS_OF: dict[type[Exception], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    errors.ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
    errors.Unavailable: grpc.StatusCode.UNAVAILABLE,
    errors.Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    ValueError: grpc.StatusCode.INVALID_ARGUMENT,
}

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for cls in type(exc).__mro__:
        code = STATUS_OF.get(cls)  # type: ignore[arg-type]
        if code is not None:
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"


def _abort(context: grpc.ServicerContext, exc: BaseException, method: str) -> None:
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("unhandled error in %s", method)
    context.abort(code, message)


def _wrap_unary(fn: Callable, method: str) -> Callable:
    def handler(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return fn(request, context)
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never a traceback
            if context.code() not in (None, grpc.StatusCode.OK):
                raise  # the servicer already aborted with its own status
            _abort(context, exc, method)

    return handler


def _wrap_stream(fn: Callable, method: str) -> Callable:
    def handler(request: Any, context: grpc.ServicerContext) -> Iterable[Any]:
        try:
            yield from fn(request, context)
        except Exception as exc:  # noqa: BLE001
            if context.code() not in (None, grpc.StatusCode.OK):
                raise  # the servicer already aborted with its own status
            _abort(context, exc, method)

    return handler


class ErrorMappingInterceptor(grpc.ServerInterceptor):
    """Maps kvmesh.contract.errors (and ValueError) raised by a servicer to their status codes."""

    def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method),
                handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method),
                handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary, method),
                handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            _wrap_stream(handler.stream_stream, method),
            handler.request_deserializer, handler.response_serializer)


class GrpcServer:
    """A grpc server with health, reflection, the error interceptor and graceful stop."""

    def __init__(self, host: str, port: int, max_workers: int = 32,
                 interceptors: list[grpc.ServerInterceptor] | None = None, token_name: str = "admin token",
                 max_concurrent_rpcs: int | None = None) -> None:
        sec = security.current()
        auth = [security.BearerTokenInterceptor(sec.server_token, token_name)] if sec.server_token else []
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
            interceptors=[*auth, *(interceptors or []), ErrorMappingInterceptor()],
            options=CHANNEL_OPTIONS,
            maximum_concurrent_rpcs=max_concurrent_rpcs,
        )
        self.health = health.HealthServicer(experimental_non_blocking=True)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self._service_names: list[str] = [health.SERVICE_NAME, reflection.SERVICE_NAME]
        self.address = f"{host}:{port}"
        if sec.server_tls.enabled:
            self.port = self.server.add_secure_port(self.address, security.server_credentials(sec.server_tls))
        else:
            self.port = self.server.add_insecure_port(self.address)
        if self.port == 0:
            raise OSError(f"cannot listen on {self.address}: address in use or not available")
        self._stopped = threading.Event()

    def add_service(self, full_name: str) -> None:
        self._service_names.append(full_name)
        self.health.set(full_name, health_pb2.HealthCheckResponse.NOT_SERVING)

    def start(self) -> None:
        reflection.enable_server_reflection(self._service_names, self.server)
        self.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self.server.start()

    def set_serving(self, serving: bool = True) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ["", *self._service_names[2:]]:
            self.health.set(name, status)

    def stop(self, grace: float = 5.0) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.set_serving(False)
        self.server.stop(grace).wait(grace + 1)
        # NOTE: once drained, stop(0) ends grpc's grace timer too; without it the process lingers
        # for the whole grace period at exit (a non-daemon grpc thread waits it out).
        self.server.stop(0)

    def wait_for_termination_signal(self, grace: float = 5.0, on_stop: Callable[[], None] | None = None) -> None:
        """Blocks until SIGTERM/SIGINT, then drains and stops."""
        done = threading.Event()

        def handle(signum: int, _frame: Any) -> None:
            log.info("signal %d: draining for up to %.1fs", signum, grace)
            done.set()

        signal.signal(signal.SIGTERM, handle)
        signal.signal(signal.SIGINT, handle)
        while not done.wait(0.5):
            pass
        self.stop(grace)
        if on_stop is not None:
            on_stop()


def resolve_target(target: str) -> tuple[str, list[tuple[str, object]]]:
    """``host:port`` as is; ``h1:p1,h2:p2`` (replicas) as one round-robin channel over them.

    gRPC's round_robin policy keeps a subchannel per address and skips the ones that are down,
    so a client of two kv_service replicas keeps working when one dies.
    """
    parts = [p.strip() for p in target.split(",") if p.strip()]
    if len(parts) <= 1:
        return target, []
    return "ipv4:" + ",".join(parts), [("grpc.lb_policy_name", "round_robin")]


def dial(target: str) -> grpc.Channel:
    """A channel to ``target`` (``host:port`` or a comma-separated replica list) with this
    process's client TLS and token (kvmesh/security.py)."""
    sec = security.current()
    target, extra = resolve_target(target)
    options = CHANNEL_OPTIONS + extra
    if sec.client_tls.enabled:
        ch = grpc.secure_channel(target, security.channel_credentials(sec.client_tls), options=options)
    else:
        ch = grpc.insecure_channel(target, options=options)
    return security.secure(ch, sec.client_token)

