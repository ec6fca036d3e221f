"""Errors the core raises; kvmesh/transport/ maps each to one gRPC status code, in one place.

Core modules raise these (or ValueError, which means INVALID_ARGUMENT) and never import grpc.
"""

from __future__ import annotations


class KVMeshError(Exception):
    """Base class; the message is shown to the client as is, so make it actionable.

    ``param``: the request field the error is about (an OpenAI error object's ``param``), when
    there is one; gRPC carries it in the message only.
    """

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param


class InvalidArgument(KVMeshError, ValueError):
    """The request itself is malformed (INVALID_ARGUMENT)."""


class NotFound(KVMeshError):
    """A named thing (worker, request) does not exist (NOT_FOUND)."""


class AlreadyExists(KVMeshError):
    """What the request would create exists already, e.g. a request id in use (ALREADY_EXISTS)."""


class FailedPrecondition(KVMeshError):
    """Well-formed, but refused in the current state (FAILED_PRECONDITION)."""


class ResourceExhausted(KVMeshError):
    """A limit was hit; retry later or send less (RESOURCE_EXHAUSTED)."""


class RequestTooLarge(ResourceExhausted):
    """The request itself is over a size limit (prompt tokens, max_tokens): RESOURCE_EXHAUSTED over gRPC,
    400 over HTTP, where 429 would make OpenAI clients retry a request that can only fail again."""


class Unavailable(KVMeshError):
    """A dependency is down; retrying may succeed (UNAVAILABLE)."""


class Unauthenticated(KVMeshError):
    """Missing or wrong credentials (UNAUTHENTICATED)."""
