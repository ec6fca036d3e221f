"""The one place errors become gRPC status codes (kvmesh/transport/http.py does the same for HTTP)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from kvmesh.contract import errors
from kvmesh.contract.limits import cap_message

log = logging.getLogger("kvmesh.transport.status")


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


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and (capped) message of an exception a servicer raised."""
    for cls in type(exc).__mro__:
        code = STATUS_OF.get(cls)  # type: ignore[arg-type]
        if code is not None:
            return code, cap_message(str(exc))
    return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log"


def code_of(exc: BaseException) -> int:
    """The status code number a call ends with when its servicer raised ``exc`` (a span's
    ``rpc.grpc.status_code``): the mapped code; CANCELLED for a call the caller gave up on; UNKNOWN for
    one the servicer aborted itself (``context.abort``: its code is on the context)."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED.value[0]
    if isinstance(exc, grpc.aio.AbortError):
        return grpc.StatusCode.UNKNOWN.value[0]
    return status_for(exc)[0].value[0]


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    code, message = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("unhandled error in %s", method, exc_info=exc)
    await context.abort(code, message)
