"""Channels to kvmesh servers (TLS and tokens from kvmesh/transport/security.py), sync and aio."""

from __future__ import annotations

import re
from collections.abc import Sequence

import grpc

from kvmesh.transport import security

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]

_SCHEME = re.compile(r"^(ipv4|ipv6|dns|unix|unix-abstract|vsock):")
"""A gRPC target that names its resolver (grpc/doc/naming.md)."""


def resolve_target(target: str) -> tuple[str, list[tuple[str, object]]]:
    """``host:port`` as is; ``h1:p1,h2:p2`` (replicas) as one round-robin channel over them.

    A target that names its resolver (``ipv4:h1:p1,h2:p2``, ``dns:///svc:443``, ``unix:/path``) is
    passed to gRPC unchanged, with the ``round_robin`` policy when it lists several addresses.
    gRPC's round_robin policy keeps a subchannel per address, spreads calls over them and skips the
    ones that are down: a client of two kv_service replicas keeps working when one dies, and a
    client of several routers spreads its requests without a load balancer of ours.
    """
    target = target.strip()
    if _SCHEME.match(target):
        return target, [("grpc.lb_policy_name", "round_robin")] if "," in target else []
    parts = [p.strip() for p in target.split(",") if p.strip()]
    if len(parts) <= 1:
        return target, []
    return "ipv4:" + ",".join(parts), [("grpc.lb_policy_name", "round_robin")]


def replicas(target: str) -> list[str]:
    """Each address of a replica list (``h:p1,h:p2`` or ``ipv4:h:p1,h:p2``), else the one target (a
    ``dns:///`` name stays one target: gRPC resolves it).

    For a caller that must reach every replica (``kvmesh admin audit`` sums what each holds) or deal
    calls to them in turn (``kvmesh bench``: one round_robin channel sends only to subchannels already
    connected, so a burst sent as it opens went to the first router up, 22-24 of 24 on one of three).
    """
    body = target.strip()
    scheme = body.split(":", 1)[0] if ":" in body else ""
    if scheme in ("ipv4", "ipv6"):
        body = body.split(":", 1)[1]
    elif scheme in ("dns", "unix", "unix-abstract", "vsock") or "," not in body:
        return [target]
    return [p.strip() for p in body.split(",") if p.strip()]


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


def dial_aio(target: str, options: Sequence[tuple[str, object]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to ``target`` with this process's client TLS; ``options`` replace the
    channel's defaults of the same name (a client with gRPC's own 4 MiB receive limit). The token is not
    added by an interceptor (aio interceptors wrap every call in another object): callers pass
    ``metadata=security.call_metadata()`` on each call."""
    sec = security.current()
    target, extra = resolve_target(target)
    merged = list({**dict(CHANNEL_OPTIONS), **dict(options)}.items()) + extra
    if sec.client_tls.enabled:
        return grpc.aio.secure_channel(target, security.channel_credentials(sec.client_tls), options=merged)
    return grpc.aio.insecure_channel(target, options=merged)
