"""Bearer tokens and TLS / mTLS for every server and client, configured once per process.

Two secrets (docs/security.md):
- the **API token** guards the router's public API (clients send it);
- the **admin token** guards everything inside the mesh: kv_service RPCs (admin queries, worker
  registration, events, lookups) and worker RPCs; routers, workers and `kvmesh admin` send it.
Health checks and reflection stay open (Kubernetes probes). Tokens come from a file (flag) or
an environment variable and are compared in constant time.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

API_TOKEN_ENV = "KVMESH_API_TOKEN"
ADMIN_TOKEN_ENV = "KVMESH_ADMIN_TOKEN"
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


@dataclass(slots=True)
class TLSFiles:
    """PEM files. Server: cert + key, and ``ca`` = client CA (then clients must present a cert:
    mTLS). Client: ``ca`` verifies the server; cert + key are the client's own (for mTLS)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    def _read(self, path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None


@dataclass(slots=True)
class Security:
    server_tls: TLSFiles = field(default_factory=TLSFiles)
    client_tls: TLSFiles = field(default_factory=TLSFiles)
    server_token: str | None = None
    """What this process's server requires (None = no auth)."""
    client_token: str | None = None
    """What this process sends to the servers it calls."""


_current = Security()


def configure(security: Security) -> None:
    """Sets this process's security (commands call it once, before starting servers or clients)."""
    global _current
    _current = security


def current() -> Security:
    return _current


def read_token(file: str | None, env: str) -> str | None:
    """The token from ``file`` if given, else from the environment variable ``env``; None if neither."""
    if file:
        token = Path(file).read_text().strip()
        if not token:
            raise ValueError(f"token file {file} is empty")
        return token
    return os.environ.get(env) or None


def server_credentials(tls: TLSFiles) -> grpc.ServerCredentials:
    if not (tls.cert and tls.key):
        raise ValueError("a TLS server needs both --tls-cert and --tls-key")
    ca = tls._read(tls.ca)
    return grpc.ssl_server_credentials([(tls._read(tls.key), tls._read(tls.cert))], root_certificates=ca,
                                       require_client_auth=ca is not None)


def channel_credentials(tls: TLSFiles) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=tls._read(tls.ca), private_key=tls._read(tls.key),
                                        certificate_chain=tls._read(tls.cert))


def _denied(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def abort(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(abort, handler.request_deserializer, handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(abort, handler.request_deserializer, handler.response_serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(abort, handler.request_deserializer, handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(abort, handler.request_deserializer, handler.response_serializer)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Requires ``authorization: Bearer <token>`` on every method except health and reflection."""

    def __init__(self, token: str, what: str) -> None:
        self._expected = f"Bearer {token}".encode()
        self._what = what

    async def intercept_service(self, continuation: Callable, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES):
            return handler
        got = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        if hmac.compare_digest(got.encode() if isinstance(got, str) else got, self._expected):
            return handler
        reason = "missing" if not got else "wrong"
        return _denied(handler, f"{reason} bearer token: send 'authorization: Bearer <{self._what}>'")


def call_metadata() -> tuple[tuple[str, str], ...] | None:
    """The metadata an asyncio client passes on each call (the token), or None without one."""
    token = _current.client_token
    return (("authorization", f"Bearer {token}"),) if token else None


class _AddToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._md = ("authorization", f"Bearer {token}")

    def _details(self, d: Any) -> Any:
        return _CallDetails(d.method, d.timeout, [*(d.metadata or []), self._md], d.credentials,
                            d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: list
    credentials: Any
    wait_for_ready: bool | None
    compression: Any


def secure(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    return grpc.intercept_channel(channel, _AddToken(token)) if token else channel
