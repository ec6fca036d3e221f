"""gRPC plumbing shared by every server and client: the one place errors become status codes.

Every kvmesh server is a ``grpc.aio`` server: an RPC is a coroutine on one event loop, so an
open stream costs a coroutine, not a thread. Health (grpc.health.v1) starts NOT_SERVING and turns
SERVING when the server is ready; reflection is on; SIGTERM stops accepting, drains for ``grace``
seconds, then exits.

A server's loop runs on its own thread (:class:`LoopThread`): the process's main thread keeps
signal handling, and tests start several servers in one process, each on its own loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvmesh.contract import errors
from kvmesh.transport import security

log = logging.getLogger("kvmesh.transport.rpc")

T = TypeVar("T")

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
EVENT_LOOP_ENV = "KVMESH_EVENT_LOOP"
"""``uvloop`` (the default where it is installed) or ``asyncio``: every server loop's implementation."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for cls in type(exc).__mro__:
        code = STATUS_OF.get(cls)  # type: ignore[arg-type]
        if code is not None:
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("unhandled error in %s", method, exc_info=exc)
    await context.abort(code, message)


SHUTTING_DOWN = "this server is shutting down: retry on another replica"


class DrainGate:
    """The RPCs in flight, for a graceful stop: once closed, new RPCs are refused with UNAVAILABLE
    (saying why) while those in flight get the grace to finish; past it they end UNAVAILABLE too.

    NOTE: grpc's own ``stop(grace)`` refuses new calls as well, but one arriving on an open
    connection is answered CANCELLED (a code clients do not retry, and a lie: nobody cancelled),
    and one on a new connection meets a closed port. Health and reflection are not gated: probes
    read NOT_SERVING while it drains.
    """

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task] = set()
        self._idle: asyncio.Event | None = None
        self.closed = False
        self.expired = False

    def enter(self) -> asyncio.Task | None:
        """Counts the calling RPC's task in and returns it; None when closed (refuse the RPC)."""
        if self.closed:
            return None
        task = asyncio.current_task()
        assert task is not None  # grpc.aio runs every RPC in a task
        self._tasks.add(task)
        return task

    def leave(self, task: asyncio.Task) -> None:
        # NOTE: the task that entered, not current_task(): a stream whose client went away may
        # be closed (its finally run) from the loop's async-generator finalizer, in another task.
        self._tasks.discard(task)
        if not self._tasks and self._idle is not None:
            self._idle.set()

    async def drain(self, grace: float) -> None:
        """Closes the gate, waits up to ``grace`` for the RPCs in flight, then cuts the rest."""
        self.closed = True
        if self._tasks:
            self._idle = asyncio.Event()
            try:
                await asyncio.wait_for(self._idle.wait(), grace)
            except asyncio.TimeoutError:  # noqa: UP041 - TimeoutError only from Python 3.11
                log.warning("%.1fs grace over with %d RPC(s) in flight: ending them", grace, len(self._tasks))
        self.expired = True
        for task in list(self._tasks):
            task.cancel()  # the wrapper turns it into UNAVAILABLE (see _gated)
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=1.0)


async def _refuse_or_cut(context: grpc.aio.ServicerContext, gate: DrainGate) -> None:
    await context.abort(grpc.StatusCode.UNAVAILABLE,
                        SHUTTING_DOWN if not gate.expired else "this server is shutting down: the drain grace ran out")


def _wrap_unary(fn: Callable[..., Awaitable[Any]], method: str, gate: DrainGate) -> Callable[..., Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        task = gate.enter()
        if task is None:
            await _refuse_or_cut(context, gate)
        try:
            return await fn(request, context)
        except grpc.aio.AbortError:
            raise  # the servicer already aborted with its own status
        except asyncio.CancelledError:
            if not gate.expired:
                raise  # the client went away (or its deadline passed)
            await _refuse_or_cut(context, gate)
        except Exception as exc:  # noqa: BLE001 - mapped to a status, never a traceback
            await _abort(context, exc, method)
        finally:
            gate.leave(task)  # type: ignore[arg-type]

    return handler


def _wrap_stream(fn: Callable[..., AsyncIterator[Any]], method: str, gate: DrainGate) -> Callable[..., AsyncIterator[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        task = gate.enter()
        if task is None:
            await _refuse_or_cut(context, gate)
        try:
            async for item in fn(request, context):
                yield item
        except grpc.aio.AbortError:
            raise
        except asyncio.CancelledError:
            if not gate.expired:
                raise
            await _refuse_or_cut(context, gate)
        except Exception as exc:  # noqa: BLE001
            await _abort(context, exc, method)
        finally:
            gate.leave(task)  # type: ignore[arg-type]

    return handler


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps kvmesh.contract.errors (and ValueError) raised by a servicer to their status codes, and
    keeps the server's DrainGate (one wrapper per call for both: an interceptor layer costs).

    Health and reflection are left as they are (they abort with their own codes, and stay open
    while the server drains).
    """

    def __init__(self, gate: DrainGate) -> None:
        self.gate = gate

    async def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(security.OPEN_SERVICES):
            return handler
        g = self.gate
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method, g),
                handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method, g),
                handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary, method, g),
                handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            _wrap_stream(handler.stream_stream, method, g),
            handler.request_deserializer, handler.response_serializer)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A fresh loop of the implementation ``$KVMESH_EVENT_LOOP`` names: uvloop unless it says
    ``asyncio`` or uvloop is not installed (docs/architecture.md)."""
    kind = os.environ.get(EVENT_LOOP_ENV, "")
    if kind not in ("", "asyncio", "uvloop"):
        raise ValueError(f"${EVENT_LOOP_ENV} must be 'asyncio' or 'uvloop', got {kind!r}")
    if kind != "asyncio":
        # NOTE: measured side by side (docs/benchmarks.md, "Control plane on asyncio"): a grpc.aio
        # round trip and a Lookup take 15-45 % less time on uvloop than on asyncio's own loop.
        try:
            import uvloop
        except ImportError:
            if kind == "uvloop":
                raise
        else:
            return uvloop.new_event_loop()
    return asyncio.new_event_loop()


class LoopThread:
    """An event loop running on a daemon thread; ``run`` executes a coroutine on it and waits."""

    def __init__(self, name: str) -> None:
        self.loop = new_event_loop()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()
        # NOTE: whatever is still pending (a stream the client never closed) is cancelled so
        # its finally blocks run before the loop closes.
        pending = asyncio.all_tasks(self.loop)
        for task in pending:
            task.cancel()
        if pending:
            self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())
        self.loop.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if not self._thread.is_alive():
            coro.close()
            raise RuntimeError(f"the event loop of {self._thread.name} has stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


class AioServer:
    """A ``grpc.aio`` server with health, reflection, the auth and error interceptors and
    graceful stop. Build it on the loop that will run it."""

    def __init__(self, host: str, port: int, token_name: str = "admin token") -> None:
        sec = security.current()
        auth = [security.BearerTokenInterceptor(sec.server_token, token_name)] if sec.server_token else []
        self.gate = DrainGate()
        self.server = grpc.aio.server(interceptors=[*auth, ErrorMappingInterceptor(self.gate)],
                                      options=CHANNEL_OPTIONS)
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
        reflection.enable_server_reflection(self._service_names, self.server)
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


def wait_for_termination_signal(stop: Callable[[float], None], grace: float = 5.0) -> None:
    """Blocks the main thread until SIGTERM/SIGINT, then calls ``stop(grace)`` (drain and exit)."""
    done = threading.Event()

    def handle(signum: int, _frame: Any) -> None:
        log.info("signal %d: draining for up to %.1fs", signum, grace)
        done.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    while not done.wait(0.5):
        pass
    stop(grace)


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
    """A blocking channel to ``target`` (``host:port`` or a comma-separated replica list) with this
    process's client TLS and token (kvmesh/transport/security.py)."""
    sec = security.current()
    target, extra = resolve_target(target)
    options = CHANNEL_OPTIONS + extra
    if sec.client_tls.enabled:
        ch = grpc.secure_channel(target, security.channel_credentials(sec.client_tls), options=options)
    else:
        ch = grpc.insecure_channel(target, options=options)
    return security.secure(ch, sec.client_token)


def dial_aio(target: str) -> grpc.aio.Channel:
    """An asyncio channel to ``target`` with this process's client TLS. The token is not added
    by an interceptor (aio interceptors wrap every call in another object): callers pass
    ``metadata=security.call_metadata()`` on each call."""
    sec = security.current()
    target, extra = resolve_target(target)
    options = CHANNEL_OPTIONS + extra
    if sec.client_tls.enabled:
        return grpc.aio.secure_channel(target, security.channel_credentials(sec.client_tls), options=options)
    return grpc.aio.insecure_channel(target, options=options)
