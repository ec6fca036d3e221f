"""Test and benchmark helpers (not used by the services)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def wait_until(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Polls ``cond`` every 50 ms; raises AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def varint(n: int) -> bytes:
    """``n`` as a protobuf base-128 varint (hand-built wire bytes: invalid UTF-8 and oversized fields)."""
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def wire_field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field on the wire (string, bytes, message)."""
    return varint(number << 3 | 2) + varint(len(payload)) + payload

