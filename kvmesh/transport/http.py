"""HTTP plumbing of the OpenAI-compatible API: the one place kvmesh errors become HTTP statuses and
OpenAI error objects, and the API token check of HTTP requests.

The statuses follow gRPC's own HTTP mapping (google.rpc.Code), with one exception: a request over
one of the router's size limits (``RequestTooLarge``, a ResourceExhausted) is 400, not 429, because
OpenAI clients retry 429 and the same request would be refused again.
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from kvmesh.contract import errors

log = logging.getLogger("kvmesh.transport.http")

STATUS_OF: dict[type[Exception], int] = {
    errors.InvalidArgument: 400,
    errors.NotFound: 404,
    errors.AlreadyExists: 409,
    errors.FailedPrecondition: 400,
    errors.RequestTooLarge: 400,
    errors.ResourceExhausted: 429,
    errors.Unavailable: 503,
    errors.Unauthenticated: 401,
    ValueError: 400,
}
"""Every class of kvmesh/transport/'s STATUS_OF has a status here (tests/router/api/test_openai_http.py checks)."""

ERROR_TYPE_OF: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}
"""A status not listed is ``invalid_request_error`` below 500 and ``server_error`` from 500 on."""

WWW_AUTHENTICATE = (b"www-authenticate", b'Bearer realm="kvmesh"')
"""The header every 401 carries (RFC 6750): the scheme the client must use."""


def error_type(status: int) -> str:
    return ERROR_TYPE_OF.get(status, "invalid_request_error" if status < 500 else "server_error")


def status_for(exc: BaseException) -> tuple[int, str]:
    """(HTTP status, message) of an exception; unknown ones are 500 with no internals shown."""
    for cls in type(exc).__mro__:
        status = STATUS_OF.get(cls)  # type: ignore[arg-type]
        if status is not None:
            return status, str(exc)
    return 500, f"internal error ({type(exc).__name__}); see the server log"


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """An OpenAI error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": error_type(status), "param": param, "code": code}}


def param_of(exc: BaseException) -> str | None:
    """The request field an error names (``KVMeshError.param``), if any."""
    return getattr(exc, "param", None)


def check_bearer(authorization: str | None, token: str | None) -> str | None:
    """None when the request may pass (``token`` None: no auth, or the right one sent); else why not."""
    if not token:
        return None
    scheme, _, credentials = (authorization or "").strip().partition(" ")
    # NOTE: the scheme is case-insensitive (RFC 7235 section 2.1); the token is compared in constant time.
    if scheme.lower() == "bearer" and hmac.compare_digest(credentials.strip().encode(), token.encode()):
        return None
    reason = "missing" if not authorization else "wrong"
    return f"{reason} API key: send the header 'Authorization: Bearer <api token>'"
