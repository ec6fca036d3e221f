"""Read timeouts for the HTTP server: uvicorn's HTTP/1.1 protocol (h11) with a guard on every
connection until its request has arrived.

uvicorn closes idle keep-alive connections but has no timeout for a request that is still arriving:
a client that connects and sends nothing, sends half its headers, or sends a body shorter than its
``Content-Length`` holds a connection (and, mid-body, the request's task) for as long as it likes.
This protocol adds, per connection:

- **header timeout**: the request line and headers must arrive within ``header_timeout_s`` of the
  connection opening (or, on a kept-alive connection, of the next request's first byte); past it a
  connection that sent something gets ``408`` and is closed, one that sent nothing is closed;
- **body timeout**: the body must arrive within ``body_timeout_s`` of the headers; past it the
  request gets ``408`` (unless its response has started: a request refused early has its body
  drained, and is closed) and the connection is closed;
- **unfinished cap**: a client (peer address) may hold ``max_unfinished`` connections whose request
  has been arriving for more than ``STALE_S`` (or a quarter of the header timeout, if shorter); a
  new connection past that gets ``429`` and is
  closed. A connection counts only once it is stale, so a load generator that opens a thousand
  connections at once is not refused for the instant before their requests arrive.

**Lingering close.** A request answered before its body was read (a 401, a 413 on its declared
length, a 415, a body refused at its first element past a bound) is answered with ``connection:
close``; then, instead of closing at once (the kernel answers the unread body with a reset, and a
client that sends its whole body before reading — urllib, requests, many SDKs — saw only
"Connection reset by peer"), the connection half-closes (FIN after the answer, where TCP allows it)
and reads and drops the rest of the body, without parsing it, for at most ``linger_bytes`` bytes
and ``linger_s`` seconds, then closes. Apache and nginx do the same (``lingering_close``). A
lingering connection is not an unfinished request (the unfinished cap does not count it) and costs
the loop one counter update per chunk; the bounds keep what one client can make the router read.

Headers over h11's incomplete-event limit (16 KiB, ``h11_max_incomplete_event_size``) get uvicorn's
own ``400``. docs/security.md lists every limit with its flag.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_DISCARD = bytearray(1 << 20)
"""recv's buffer for a lingering connection's discarded bytes: with MSG_TRUNC the kernel drops them
without copying them here (Linux, TCP)."""
STALE_S = 1.0
"""Seconds a request may be arriving before its connection counts toward ``max_unfinished`` (a
quarter of the header timeout when that is shorter)."""


@dataclass(slots=True)
class ReadGuard:
    """The limits, and the stale-connection count per client, shared by one server's connections."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_unfinished: int = 256
    linger_bytes: int = 64 * 1024 * 1024
    """After an early answer, body bytes read and dropped at most before the connection closes."""
    linger_s: float = 10.0
    """After an early answer, seconds the rest of the body is read and dropped at most."""
    stale: Counter[str] = field(default_factory=Counter)
    """Stale unfinished connections per client address now."""
    lingered: Counter[str] = field(default_factory=Counter)
    """Lingering closes so far, by how the rest of the body was dropped: ``kernel`` (MSG_TRUNC) or ``read``."""

    @property
    def stale_after_s(self) -> float:
        return min(STALE_S, self.header_timeout_s / 4) if self.header_timeout_s > 0 else STALE_S

    def protocol(self) -> type[H11Protocol]:
        """The uvicorn protocol class (``uvicorn.Config(http=...)``) bound to this guard."""
        return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": self})


def raw_response(status: int, reason: str, message: str) -> bytes:
    """A whole HTTP/1.1 response with an OpenAI error object, for a connection h11 cannot answer on."""
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                 else "server_error", "param": None, "code": None}}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode()
    return head + body


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: ``close`` lingers while a body is still arriving."""

    def __init__(self, transport: asyncio.Transport, protocol: GuardedH11Protocol) -> None:
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        if not self._protocol._linger():
            self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the guard's timeouts, cap and lingering close (see the module docstring)."""

    guard: ReadGuard

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._phase: str | None = None
        """"headers" or "body" while a request is arriving, else None."""
        self._timer: asyncio.TimerHandle | None = None
        self._stale_timer: asyncio.TimerHandle | None = None
        self._counted = False
        self._received = False
        """Any byte of the current request has arrived."""
        self._peer = ""
        self._drained = 0
        self._raw: asyncio.Transport | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._discard: socket.socket | None = None
        """A duplicate of the connection's socket that drops what arrives (lingering, where MSG_TRUNC works)."""
        self.lingering = False
        """The answer is out and the connection is reading and dropping the rest of the body."""

    # -- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._raw = transport
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
        self._peer = self.client[0] if self.client else ""
        if self.guard.stale[self._peer] >= self.guard.max_unfinished:
            transport.write(raw_response(429, "Too Many Requests", (
                f"this client has {self.guard.max_unfinished} connections whose requests have not finished "
                "arriving (--http-max-unfinished): finish or close them first")))
            transport.close()
            return
        self._enter("headers")

    def data_received(self, data: bytes) -> None:
        self._received = True
        if self.lingering or (self.cycle is not None and self.cycle.response_complete
                              and self.conn.their_state is h11.SEND_BODY):
            # NOTE: the answer is out and this is the rest of a body nobody will read.
            self._drained += len(data)
            if self._drained > self.guard.linger_bytes:
                self._close_now()
                return
            if self.lingering:
                return  # NOTE: dropped unparsed: a counter update per chunk is all it costs
        super().data_received(data)
        self._follow()

    def eof_received(self) -> bool | None:
        if self.lingering:
            self._close_now()  # the client sent all it had (and has the answer)
            return None
        return super().eof_received()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._enter(None)
        if self._linger_timer is not None or self._discard is not None:
            self._close_now()
        super().connection_lost(exc)

    # -- lingering close --------------------------------------------------------------------------
    def _linger(self) -> bool:
        """uvicorn closes the connection: True when it lingers instead (an answer went out while the
        request's body was still arriving, within the bounds)."""
        raw = self._raw
        if (self.lingering or raw is None or raw.is_closing() or self.conn.their_state is not h11.SEND_BODY
                or self.guard.linger_s <= 0 or self._drained > self.guard.linger_bytes):
            return self.lingering
        self.lingering = True
        self._enter(None)  # NOTE: no longer an unfinished request: the linger bounds hold it now
        if raw.can_write_eof():
            raw.write_eof()  # FIN after the answer: the client may send on and read it when it is done
        self._linger_timer = self.loop.call_later(self.guard.linger_s, self._close_now)
        if self._discard_in_kernel(raw):
            self.guard.lingered["kernel"] += 1
        else:
            self.guard.lingered["read"] += 1
            raw.resume_reading()  # NOTE: uvicorn may have paused reading while the app held a full buffer
        return True

    def _discard_in_kernel(self, raw: asyncio.Transport) -> bool:
        """Drops the rest of the body in the kernel: the transport stops reading, and a duplicate of its
        socket receives with MSG_TRUNC (no copy to user space; the front-door benchmark's 34 MB bodies
        cost the loop ~7 ms each when read through the transport). False where that cannot be done
        (not Linux, TLS: its records are dropped with the rest, but the transport must see its alerts)."""
        sock = raw.get_extra_info("socket")
        if not hasattr(socket, "MSG_TRUNC") or sock is None or raw.get_extra_info("sslcontext") is not None:
            return False
        try:
            dup = socket.socket(fileno=os.dup(sock.fileno()))
            dup.setblocking(False)
            self.loop.add_reader(dup.fileno(), self._drop_in_kernel)
        except (OSError, ValueError, RuntimeError, NotImplementedError):
            return False
        raw.pause_reading()
        self._discard = dup
        return True

    def _drop_in_kernel(self) -> None:
        dup = self._discard
        if dup is None:
            return
        try:
            n = dup.recv_into(_DISCARD, len(_DISCARD), socket.MSG_TRUNC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            n = 0
        self._drained += n
        if not n or self._drained > self.guard.linger_bytes:
            self._close_now()  # the client is done (EOF), or past the bound

    def _close_now(self) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        if self._discard is not None:
            dup, self._discard = self._discard, None
            with contextlib.suppress(Exception):
                self.loop.remove_reader(dup.fileno())
            dup.close()
        if self._raw is not None:
            self._raw.close()

    # -- phases ---------------------------------------------------------------------------------
    def _follow(self) -> None:
        """Moves to the phase h11's view of the client's side says."""
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._enter("body")  # NOTE: also while an early answer's unread body drains
        elif state is h11.IDLE and self.conn.trailing_data[0]:
            self._enter("headers")  # part of a request line or headers is waiting in h11's buffer
        else:
            self._enter(None)  # the request is in (DONE), the connection idles kept alive, or it is ending

    def _enter(self, phase: str | None) -> None:
        if phase == self._phase:
            return
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if phase is None:
            self._received = False
            self._drained = 0
            if self._stale_timer is not None:
                self._stale_timer.cancel()
                self._stale_timer = None
            if self._counted:
                self._counted = False
                self.guard.stale[self._peer] -= 1
                if self.guard.stale[self._peer] <= 0:
                    del self.guard.stale[self._peer]
        else:
            limit = self.guard.header_timeout_s if phase == "headers" else self.guard.body_timeout_s
            if limit > 0:
                self._timer = self.loop.call_later(limit, self._timed_out, phase)
            if self._stale_timer is None and not self._counted:
                self._stale_timer = self.loop.call_later(self.guard.stale_after_s, self._mark_stale)
        self._phase = phase

    def _mark_stale(self) -> None:
        self._stale_timer = None
        if self._phase is not None and not self._counted:
            self._counted = True
            self.guard.stale[self._peer] += 1

    def _timed_out(self, phase: str) -> None:
        self._timer = None
        if self.transport.is_closing():
            return
        if phase == "headers":
            if self._received:
                self.transport.write(raw_response(408, "Request Timeout", (
                    f"the request's headers did not arrive within {self.guard.header_timeout_s:g}s "
                    "(--http-header-timeout)")))
        elif self.cycle is not None and not self.cycle.response_started:
            body = json.dumps({"error": {"message": (
                f"the request body did not arrive within {self.guard.body_timeout_s:g}s of its headers "
                "(--http-body-timeout)"), "type": "invalid_request_error", "param": None, "code": None}}).encode()
            try:
                self.transport.write(self.conn.send(h11.Response(status_code=408, reason=b"Request Timeout", headers=[
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close")])) or b"")
                self.transport.write(self.conn.send(h11.Data(data=body)) or b"")
                self.transport.write(self.conn.send(h11.EndOfMessage()) or b"")
            except h11.LocalProtocolError:
                pass  # NOTE: h11 refused (a state it does not allow a response in): the close below still ends it
            self.cycle.response_started = self.cycle.response_complete = True
        if self.cycle is not None:
            # NOTE: the app, waiting for the body, hears the client left; anything it sends is dropped.
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self._close_now()  # NOTE: past a read timeout the connection closes; it does not linger
        self._enter(None)
