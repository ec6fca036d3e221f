"""Bounds on what a client may send, and how client input may appear in an error message.

Every id and string field of the API is bounded here, once, for every service; the .proto comments
state the same numbers. A status message travels in gRPC trailers, whose size is limited (16 KiB
by default; a client past it sees RESOURCE_EXHAUSTED or, with @grpc/grpc-js, a hung call): client
input is quoted only through :func:`excerpt`, and kvmesh/transport/ caps every status message
at :data:`MAX_STATUS_MESSAGE_BYTES` as a backstop.

No grpc and no redis here.
"""

from __future__ import annotations

from typing import Any

from kvmesh.contract.errors import InvalidArgument

MAX_WORKER_ID_CHARS = 128
"""Worker ids: 1-128 characters of letters, digits and ``. _ : @ / -``."""
MAX_MODEL_ID_CHARS = 512
MAX_ADDRESS_CHARS = 255
"""A worker's ``host:port``."""
MAX_REQUEST_ID_CHARS = 128
"""A client's request id (router). The router forwards it with a 13-character suffix."""
MAX_WORKER_REQUEST_ID_CHARS = 256
"""A worker's request id (Worker.Generate / Abort)."""
MAX_ADMITTED_IDS = 4096
"""Admitted request ids one load report lists (a worker keeps at most this many unacknowledged)."""
MAX_ADAPTERS = 1024
"""LoRA adapters one load report lists (WorkerLoad.adapters)."""
MAX_ADAPTER_NAME_CHARS = 256
MAX_ADAPTER_PATH_CHARS = 4096
"""A LoRA adapter's directory as LoadAdapter names it."""
MAX_CACHE_SALT_CHARS = 1024
MAX_EXTRA_KEYS_CHARS = 1024
MAX_CHAIN_BLOCKS = 65_536
"""Block hashes in one Lookup (and in one event or snapshot message)."""
MAX_SNAPSHOT_HOST_BLOCKS = 1 << 20
"""Host-tier block hashes in one snapshot message (a host tier is several times the device pool; 2**20
hashes are ~18 MiB on the wire). A worker with a larger tier snapshots its most recent ones."""
MAX_TOKEN_ID = 2**31
"""Token ids are hashed as int32 (docs/block-hashing.md): every id must be below this."""
MAX_STOP_TOKEN_IDS = 1024
"""Stop token ids in one request's sampling parameters."""

EXCERPT_CHARS = 40
"""Characters of client input an error message quotes at most."""
MAX_STATUS_MESSAGE_BYTES = 1024
"""A status message longer than this (UTF-8) is cut by the error interceptor."""


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """``repr(value)``, cut to about ``limit`` characters with its full length named when cut:
    ``'wwww…' (70000 characters)``. The one way client input enters an error message."""
    if isinstance(value, str | bytes) and len(value) > limit:
        kind = "bytes" if isinstance(value, bytes) else "characters"
        return f"{value[:limit]!r}… ({len(value)} {kind})"
    text = repr(value)
    return text if len(text) <= limit + 2 else text[:limit] + "…"


def check_id(what: str, value: str, max_chars: int, *, allow_empty: bool = False) -> None:
    """Raises InvalidArgument unless ``value`` is 1..max_chars printable ASCII characters: ids are
    written to log lines (no control characters to forge one) and returned in gRPC metadata (an
    HTTP/2 header value: ASCII only). Empty passes when ``allow_empty``."""
    if not value:
        if allow_empty:
            return
        raise InvalidArgument(f"{what} is empty: give 1-{max_chars} printable ASCII characters")
    if len(value) > max_chars:
        raise InvalidArgument(f"{what} has {len(value)} characters; at most {max_chars} are allowed")
    if not (value.isascii() and value.isprintable()):
        raise InvalidArgument(f"{what} {excerpt(value)} is not printable ASCII: use letters, digits and "
                              "punctuation only")


def check_length(what: str, value: str, max_chars: int) -> None:
    """Raises InvalidArgument when ``value`` is longer than ``max_chars`` characters."""
    if len(value) > max_chars:
        raise InvalidArgument(f"{what} has {len(value)} characters; at most {max_chars} are allowed")


def cap_message(message: str, limit: int = MAX_STATUS_MESSAGE_BYTES) -> str:
    """``message`` cut to at most ``limit`` UTF-8 bytes (on a character boundary), marked when cut."""
    raw = message.encode("utf-8", "replace")
    if len(raw) <= limit:
        return message
    marker = " … (message truncated)"
    return raw[: limit - len(marker.encode())].decode("utf-8", "ignore") + marker
