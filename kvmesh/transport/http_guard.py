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

A request answered before its body was read (a 401, a body refused at its first element past a
bound) has the rest of its body read and dropped up to ``DRAIN_BYTES``, so that a client that sends
its whole body before reading gets the answer, not a reset; past that the connection is closed:
an attacker resending a 64 MiB body costs the router 1 MiB each time, not 64.

Headers over h11's incomplete-event limit (16 KiB, ``h11_max_incomplete_event_size``) get uvicorn's
own ``400``. docs/security.md lists every limit with its flag.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DRAIN_BYTES = 1024 * 1024
"""Bytes of an answered request's unread body dropped before the connection is closed instead."""
STALE_S = 1.0
"""Seconds a request may be arriving before its connection counts toward ``max_unfinished`` (a
quarter of the header timeout when that is shorter)."""


@dataclass(slots=True)
class ReadGuard:
    """The limits, and the stale-connection count per client, shared by one server's connections."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_unfinished: int = 256
    stale: Counter[str] = field(default_factory=Counter)
    """Stale unfinished connections per client address now."""

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


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the guard's timeouts and cap (see the module docstring)."""

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

    # -- asyncio.Protocol -------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
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
        if self.cycle is not None and self.cycle.response_complete and self.conn.their_state is h11.SEND_BODY:
            # NOTE: the answer is out and this is the rest of a body nobody will read.
            self._drained += len(data)
            if self._drained > DRAIN_BYTES:
                self.transport.close()
                return
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._enter(None)
        super().connection_lost(exc)

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
        self.transport.close()
        self._enter(None)
