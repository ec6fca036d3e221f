"""The server interceptor every kvmesh service runs: undecodable requests refused naming the field,
the drain gate, and every error mapped to its status code (kvmesh/transport/status.py) with its
message capped."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from kvmesh.contract.limits import cap_message
from kvmesh.transport import security
from kvmesh.transport.drain import SHUTTING_DOWN, DrainGate
from kvmesh.transport.status import abort_with
from kvmesh.transport.wire import Undecodable, checked_deserializer


async def _refuse(context: grpc.aio.ServicerContext, bad: Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, cap_message(bad.message))


async def _checked_requests(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for item in requests:
        if isinstance(item, Undecodable):
            await _refuse(context, item)
        yield item


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
            await abort_with(context, exc, method)
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
            await abort_with(context, exc, method)
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
        deserializer = checked_deserializer(handler.request_deserializer)
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
