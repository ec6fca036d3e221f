"""gRPC plumbing shared by every server and client: the one place errors become status codes.

Every kvmesh server is a ``grpc.aio`` server: an RPC is a coroutine on one event loop, so an
open stream costs a coroutine, not a thread. Health (grpc.health.v1) starts NOT_SERVING and turns
SERVING when the server is ready; reflection is on (``grpc.reflection.v1`` and ``v1alpha``);
SIGTERM stops accepting, drains for ``grace`` seconds, then exits.

Bad input is answered here, once, for every service: a request that protobuf cannot decode (a
string field holding invalid UTF-8) is INVALID_ARGUMENT naming the field, not gRPC's INTERNAL
"Exception deserializing request!"; every status message is capped (client input quoted in it is
an excerpt already, kvmesh/contract/limits.py; the cap is the backstop that keeps trailers far
below gRPC's metadata limit).

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
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import _async as reflection_aio
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as reflection_v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as reflection_v1alpha_pb2_grpc

from kvmesh.contract import errors
from kvmesh.contract.limits import cap_message
from kvmesh.transport import security

log = logging.getLogger("kvmesh.transport.rpc")

T = TypeVar("T")

STATUS_OF: dict[type[Exception], grpc.StatusCode] = {
    errors.InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    errors.NotFound: grpc.StatusCode.NOT_FOUND,
    errors.AlreadyExists: grpc.StatusCode.ALREADY_EXISTS,
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
    """The status code and (capped) message of an exception a servicer raised."""
    for cls in type(exc).__mro__:
        code = STATUS_OF.get(cls)  # type: ignore[arg-type]
        if code is not None:
            return code, cap_message(str(exc))
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("unhandled error in %s", method, exc_info=exc)
    await context.abort(code, message)


# -- requests protobuf cannot decode ---------------------------------------------------------------
class Undecodable:
    """What the request deserializer returns for bytes protobuf refuses; the handler answers it
    with INVALID_ARGUMENT. (A deserializer that raises makes gRPC answer INTERNAL "Exception
    deserializing request!" and log a traceback per request.)"""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def invalid_utf8_field(desc: Descriptor, data: bytes, depth: int = 0) -> str | None:
    """The path (``events[2].stored.x``) of the first string field in ``data`` (a serialized
    ``desc`` message) that is not valid UTF-8; None when there is none or the bytes are not
    well-formed protobuf (then the caller names no field)."""
    pos, seen = 0, dict[int, int]()
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire_type = key >> 3, key & 7
            if wire_type == 0:
                _, pos = _varint(data, pos)
            elif wire_type == 1:
                pos += 8
            elif wire_type == 5:
                pos += 4
            elif wire_type == 2:
                n, pos = _varint(data, pos)
                chunk, pos = data[pos:pos + n], pos + n
                field = desc.fields_by_number.get(number)
                if field is None:
                    continue
                i = seen[number] = seen.get(number, -1) + 1
                name = f"{field.name}[{i}]" if field.is_repeated else field.name
                if field.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif field.type == FieldDescriptor.TYPE_MESSAGE and depth < 32:
                    inner = invalid_utf8_field(field.message_type, chunk, depth + 1)
                    if inner is not None:
                        return f"{name}.{inner}"
            else:
                return None  # groups or garbage: give up naming a field
    except (IndexError, ValueError):
        return None
    return None


def _checked_deserializer(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """Wraps a ``Message.FromString``: a DecodeError becomes an :class:`Undecodable` naming the field."""
    if deserializer is None:
        return None
    message_class = getattr(deserializer, "__self__", None)
    desc = getattr(message_class, "DESCRIPTOR", None)

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except DecodeError:
            name = desc.full_name if desc is not None else "request"
            field = invalid_utf8_field(desc, data) if desc is not None else None
            if field is not None:
                return Undecodable(f"{field} is not valid UTF-8: string fields of {name} must be UTF-8 text")
            return Undecodable(f"the request is not a valid {name} message (protobuf could not decode it)")

    return deserialize


async def _refuse(context: grpc.aio.ServicerContext, bad: Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, cap_message(bad.message))


async def _checked_requests(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for item in requests:
        if isinstance(item, Undecodable):
            await _refuse(context, item)
        yield item


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


async def _decoded(request: Any, context: grpc.aio.ServicerContext, streamed: bool) -> Any:
    """The request, or (client streaming) its messages checked one by one; an undecodable one is
    refused with INVALID_ARGUMENT naming the field."""
    if streamed:
        return _checked_requests(request, context)
    if isinstance(request, Undecodable):
        await _refuse(context, request)
    return request


async def _admit(request: Any, context: grpc.aio.ServicerContext, gate: DrainGate,
                 streamed: bool) -> tuple[Any, asyncio.Task]:
    """The decoded request and the call's place in the drain gate (refused while draining)."""
    request = await _decoded(request, context, streamed)
    task = gate.enter()
    if task is None:
        await _refuse_or_cut(context, gate)
    return request, task  # type: ignore[return-value]


def _wrap_unary(fn: Callable[..., Awaitable[Any]], method: str, gate: DrainGate,
                streamed: bool) -> Callable[..., Awaitable[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        request, task = await _admit(request, context, gate, streamed)
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


def _wrap_stream(fn: Callable[..., AsyncIterator[Any]], method: str, gate: DrainGate,
                 streamed: bool) -> Callable[..., AsyncIterator[Any]]:
    async def handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        request, task = await _admit(request, context, gate, streamed)
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


def _decode_checked(fn: Callable[..., Any], streamed: bool, stream_out: bool) -> Callable[..., Any]:
    """Health and reflection: only the undecodable-request answer (their own errors and the drain
    are left to them)."""
    if stream_out:
        async def stream_handler(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for item in fn(await _decoded(request, context, streamed), context):
                yield item

        return stream_handler

    async def unary_handler(request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await fn(await _decoded(request, context, streamed), context)

    return unary_handler


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps kvmesh.contract.errors (and ValueError) raised by a servicer to their status codes,
    keeps the server's DrainGate (one wrapper per call for both: an interceptor layer costs), and
    answers undecodable requests with INVALID_ARGUMENT naming the field.

    Health and reflection get the last only (they abort with their own codes, and stay open while
    the server drains).
    """

    def __init__(self, gate: DrainGate) -> None:
        self.gate = gate

    async def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        deserializer = _checked_deserializer(handler.request_deserializer)
        out = handler.response_serializer
        if method.startswith(security.OPEN_SERVICES):
            if handler.unary_unary:
                return grpc.unary_unary_rpc_method_handler(
                    _decode_checked(handler.unary_unary, False, False), deserializer, out)
            if handler.unary_stream:
                return grpc.unary_stream_rpc_method_handler(
                    _decode_checked(handler.unary_stream, False, True), deserializer, out)
            if handler.stream_unary:
                return grpc.stream_unary_rpc_method_handler(
                    _decode_checked(handler.stream_unary, True, False), deserializer, out)
            return grpc.stream_stream_rpc_method_handler(
                _decode_checked(handler.stream_stream, True, True), deserializer, out)
        g = self.gate
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                _wrap_unary(handler.unary_unary, method, g, False), deserializer, out)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                _wrap_stream(handler.unary_stream, method, g, False), deserializer, out)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                _wrap_unary(handler.stream_unary, method, g, True), deserializer, out)
        return grpc.stream_stream_rpc_method_handler(
            _wrap_stream(handler.stream_stream, method, g, True), deserializer, out)


# -- reflection v1 ---------------------------------------------------------------------------------
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
"""grpcurl and current tools ask reflection v1 first; grpcio-reflection ships only v1alpha."""


def _reflection_v1_descriptor() -> None:
    """Adds ``grpc/reflection/v1/reflection.proto`` to the default pool (so reflection can describe
    itself), derived from v1alpha's: v1 is the same messages with the same field numbers under
    another package, so the bytes on the wire are identical."""
    pool = descriptor_pool.Default()
    try:
        pool.FindServiceByName(REFLECTION_V1)
        return
    except KeyError:
        pass
    fdp = descriptor_pb2.FileDescriptorProto.FromString(reflection_v1alpha_pb2.DESCRIPTOR.serialized_pb)
    old, new = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."
    fdp.name, fdp.package = "grpc/reflection/v1/reflection.proto", "grpc.reflection.v1"
    fdp.ClearField("options")
    for message in fdp.message_type:
        for field in message.field:
            if field.HasField("type_name"):
                field.type_name = field.type_name.replace(old, new)
    for service in fdp.service:
        for m in service.method:
            m.input_type, m.output_type = m.input_type.replace(old, new), m.output_type.replace(old, new)
    pool.Add(fdp)


def enable_reflection(server: grpc.aio.Server, service_names: list[str]) -> None:
    """Serves reflection v1 and v1alpha (one servicer; v1 uses v1alpha's wire-identical messages)."""
    _reflection_v1_descriptor()
    servicer = reflection_aio.ReflectionServicer([*service_names, REFLECTION_V1])
    reflection_v1alpha_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(REFLECTION_V1, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
            servicer.ServerReflectionInfo,
            request_deserializer=reflection_v1alpha_pb2.ServerReflectionRequest.FromString,
            response_serializer=reflection_v1alpha_pb2.ServerReflectionResponse.SerializeToString),
    })])




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
