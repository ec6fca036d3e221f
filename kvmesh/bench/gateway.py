"""The gateway's side of ext_proc, played over a real gRPC stream: what Envoy sends an endpoint picker
per HTTP request (headers, body chunks, end of stream, then the response path), for the tests and
benchmarks/epp_bench.py. No Envoy binary runs anywhere in kvmesh's tests (docs/epp.md says what
that leaves untested).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2

from kvmesh.transport.channels import dial_aio

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
MODES = {"full-duplex": processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED,
         "buffered": processing_mode_pb2.ProcessingMode.BUFFERED,
         "streamed": processing_mode_pb2.ProcessingMode.STREAMED}


def header_map(headers: dict[str, str]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()])


def served_metadata(endpoint: str) -> base_pb2.Metadata:
    md = base_pb2.Metadata()
    md.filter_metadata["envoy.lb"].fields[SERVED].string_value = endpoint
    return md


def subset_metadata(endpoints: Sequence[str]) -> base_pb2.Metadata:
    md = base_pb2.Metadata()
    md.filter_metadata["envoy.lb.subset_hint"].fields[SUBSET].list_value.values.extend(
        [struct_pb2.Value(string_value=e) for e in endpoints])
    return md


@dataclass
class Answer:
    """What the endpoint picker answered a request: a pick, or an immediate response."""

    status: int | None = None
    """The immediate response's HTTP status; None for a pick."""
    error: dict[str, Any] | None = None
    """The immediate response's JSON body."""
    header: str = ""
    """The destination header's value (``ip:port[,ip:port...]``)."""
    metadata: str = ""
    """The same value from the dynamic metadata (``envoy.lb``)."""
    headers: dict[str, str] = field(default_factory=dict)
    """Every header the pick sets."""
    body: bytes | None = None
    """The body sent back (FULL_DUPLEX_STREAMED)."""
    pieces: list[tuple[int, bool]] = field(default_factory=list)
    """The messages it came back in: each one's bytes of body and its end_of_stream."""
    responses: list[str] = field(default_factory=list)
    """The kinds of ProcessingResponse, in order."""

    @property
    def endpoints(self) -> list[str]:
        return [e for e in self.header.split(",") if e]


class Exchange:
    """One HTTP request's ext_proc stream (``async with GatewayClient.exchange() as ex``)."""

    def __init__(self, call: Any, mode: str) -> None:
        self.call = call
        self.mode = mode
        self.answer = Answer()
        self._responses: asyncio.Queue[Any] = asyncio.Queue()
        self.answered = False
        """The picker has sent an immediate response (and ends the stream)."""
        self.reader = asyncio.ensure_future(self._read_all())

    async def _read_all(self) -> None:
        """Keeps a read pending from the stream's start until it ends, as Envoy does. Reading only
        after writing loses an answer that ends the stream: the picker answers 429 to the headers and
        ends the stream while the body is still being written, and grpc.aio's read after the status
        returns EOF without the message, its write fails (the flake of test_shedding_load_is_429)."""
        try:
            while True:
                r = await self.call.read()
                self._responses.put_nowait(r)
                if r is grpc.aio.EOF:
                    return
                if r.WhichOneof("response") == "immediate_response":
                    self.answered = True
                    return
        except (grpc.aio.AioRpcError, asyncio.CancelledError) as e:
            self._responses.put_nowait(e)

    async def _send(self, msg: ep.ProcessingRequest) -> bool:
        """Writes one message; False when the picker has already answered and ended the stream
        (Envoy then sends no more), whichever of that answer and this write came first."""
        try:
            await self.call.write(msg)
            return True
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            await asyncio.wait([self.reader], timeout=5.0)
            if self.answered:
                return False
            raise

    async def _read(self) -> ep.ProcessingResponse:
        r = await self._responses.get()
        if isinstance(r, BaseException):
            raise r
        if r is grpc.aio.EOF:
            raise EOFError("the endpoint picker ended the stream")
        kind = r.WhichOneof("response")
        self.answer.responses.append(kind)
        if kind == "immediate_response":
            self.answer.status = r.immediate_response.status.code
            try:
                self.answer.error = json.loads(r.immediate_response.body)
            except ValueError:
                self.answer.error = {"raw": r.immediate_response.body.decode("latin-1")}
            return r
        common = getattr(r, kind).response if kind in ("request_headers", "request_body") else None
        if common is not None:
            for h in common.header_mutation.set_headers:
                self.answer.headers[h.header.key] = (h.header.raw_value or h.header.value.encode()).decode()
            if DESTINATION in self.answer.headers:
                self.answer.header = self.answer.headers[DESTINATION]
            if common.body_mutation.HasField("streamed_response"):
                streamed = common.body_mutation.streamed_response
                self.answer.body = (self.answer.body or b"") + streamed.body
                self.answer.pieces.append((len(streamed.body), streamed.end_of_stream))
        if r.HasField("dynamic_metadata") and "envoy.lb" in r.dynamic_metadata.fields:
            self.answer.metadata = r.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value
        return r

    async def request(self, path: str, body: bytes | None, *, chunks: int = 1, headers: dict[str, str] | None = None,
                      subset: Sequence[str] | None = None, end: bool = True, trailers: bool = False) -> Answer:
        """Sends the request (``body`` None: a bodyless GET) in ``chunks`` pieces (BUFFERED: whole, as Envoy
        sends it); ``end`` False stops before the end of stream (a truncated body); ``trailers``: the body
        ends with request trailers instead of ``end_of_stream``, as Envoy sends a body that has them
        (BUFFERED: after the body's answer). Returns the answer once it is complete (or, with ``end``
        False, at once)."""
        h = {":method": "POST" if body is not None else "GET", ":path": path, ":authority": "gateway",
             "content-type": "application/json", **(headers or {})}
        if body is not None:
            h["content-length"] = str(len(body))
        msg = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=header_map(h), end_of_stream=body is None))
        if self.mode in MODES:
            msg.protocol_config.request_body_mode = MODES[self.mode]
            msg.protocol_config.response_body_mode = MODES[self.mode]
        if subset is not None:
            msg.metadata_context.CopyFrom(subset_metadata(subset))
        if not await self._send(msg) or body is None:
            await self._read()
            return self.answer
        if self.mode != "full-duplex" and (await self._read()).WhichOneof("response") == "immediate_response":
            return self.answer
        size = -(-len(body) // max(1, chunks if self.mode != "buffered" else 1)) or 1
        pieces = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
        for i, piece in enumerate(pieces):
            last = end and i == len(pieces) - 1
            msg = ep.ProcessingRequest(request_body=ep.HttpBody(body=piece, end_of_stream=last and not trailers))
            if not await self._send(msg):
                return await self._until_answered(trailers=False)
            if (self.mode != "full-duplex" and not last and end
                    and (await self._read()).WhichOneof("response") == "immediate_response"):
                return self.answer
        if not end:
            return self.answer
        if trailers:
            if self.mode != "full-duplex":
                await self._until_answered(trailers=False)
                if self.answer.status is not None:
                    return self.answer
            await self._send(ep.ProcessingRequest(request_trailers=ep.HttpTrailers()))
        return await self._until_answered(trailers)

    async def _until_answered(self, trailers: bool) -> Answer:
        """Reads to the end of the request's answer: an immediate response, else the trailers' answer
        (``trailers``), else the body's (FULL_DUPLEX_STREAMED: its last piece, ``end_of_stream``)."""
        while True:
            r = await self._read()
            kind = r.WhichOneof("response")
            if kind == "immediate_response" or (trailers and kind == "request_trailers"):
                return self.answer
            if not trailers and kind == "request_body" and (
                    self.mode != "full-duplex" or r.request_body.response.body_mutation.streamed_response.end_of_stream):
                return self.answer

    async def response(self, status: int = 200, body: bytes = b"", *, served: str | None = None,
                       streamed: bool = False, chunks: int = 1) -> None:
        """Plays the response path: headers (with the served endpoint's metadata), the body in chunks."""
        h = {":status": str(status), "content-type": "text/event-stream" if streamed else "application/json"}
        msg = ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=header_map(h)))
        if served is not None:
            msg.metadata_context.CopyFrom(served_metadata(served))
        await self.call.write(msg)
        await self._read()
        size = -(-len(body) // max(1, chunks)) or 1
        pieces = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
        for i, piece in enumerate(pieces):
            await self.call.write(ep.ProcessingRequest(response_body=ep.HttpBody(
                body=piece, end_of_stream=i == len(pieces) - 1)))
            echoed = 0
            while True:  # FULL_DUPLEX_STREAMED: a large chunk comes back in several pieces
                r = await self._read()
                if self.mode != "full-duplex" or r.WhichOneof("response") != "response_body":
                    break
                echoed += len(r.response_body.response.body_mutation.streamed_response.body)
                if echoed >= len(piece):
                    break

    async def close(self) -> None:
        await self.call.done_writing()


class GatewayClient:
    """ext_proc streams to one endpoint picker, as a gateway opens them (one per HTTP request)."""

    def __init__(self, target: str, max_receive_bytes: int | None = None) -> None:
        """``max_receive_bytes``: the channel's receive limit (default kvmesh's 64 MiB; gRPC's own is 4 MiB)."""
        options = [("grpc.max_receive_message_length", max_receive_bytes)] if max_receive_bytes else []
        self.channel = dial_aio(target, options)
        self.stub = ep_grpc.ExternalProcessorStub(self.channel)

    def exchange(self, mode: str = "full-duplex", timeout: float = 30.0) -> _ExchangeContext:
        return _ExchangeContext(self, mode, timeout)

    async def pick(self, path: str, body: dict | bytes | None, mode: str = "full-duplex", timeout: float = 30.0,
                   **kw: Any) -> Answer:
        """One request's answer (the stream then ends, as a gateway's does after a request)."""
        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        async with self.exchange(mode, timeout) as ex:
            return await ex.request(path, raw, **kw)

    async def close(self) -> None:
        await self.channel.close()


class _ExchangeContext:
    def __init__(self, client: GatewayClient, mode: str, timeout: float) -> None:
        self.client, self.mode, self.timeout = client, mode, timeout
        self.ex: Exchange | None = None

    async def __aenter__(self) -> Exchange:
        self.ex = Exchange(self.client.stub.Process(timeout=self.timeout), self.mode)
        return self.ex

    async def __aexit__(self, *exc: Any) -> None:
        assert self.ex is not None
        if exc[0] is None and not self.ex.call.done():
            await self.ex.close()
        self.ex.call.cancel()
        self.ex.reader.cancel()
