"""The gateway's side of ext_proc, played over a real gRPC stream: what Envoy sends an endpoint picker
per HTTP request (headers, body chunks, end of stream, then the response path), for the tests and
benchmarks/epp_bench.py. No Envoy binary runs anywhere in kvmesh's tests (docs/epp.md says what
that leaves untested).
"""

from __future__ import annotations

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

    async def _read(self) -> ep.ProcessingResponse:
        r = await self.call.read()
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
                self.answer.body = (self.answer.body or b"") + common.body_mutation.streamed_response.body
        if r.HasField("dynamic_metadata") and "envoy.lb" in r.dynamic_metadata.fields:
            self.answer.metadata = r.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value
        return r

    async def request(self, path: str, body: bytes | None, *, chunks: int = 1, headers: dict[str, str] | None = None,
                      subset: Sequence[str] | None = None, end: bool = True) -> Answer:
        """Sends the request (``body`` None: a bodyless GET) in ``chunks`` pieces; ``end`` False stops
        before the end of stream (a truncated body). Returns the answer once it is complete (or, with
        ``end`` False, at once)."""
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
        await self.call.write(msg)
        if body is None:
            await self._read()
            return self.answer
        if self.mode != "full-duplex" and (await self._read()).WhichOneof("response") == "immediate_response":
            return self.answer
        size = -(-len(body) // max(1, chunks)) or 1
        pieces = [body[i:i + size] for i in range(0, len(body), size)] or [b""]
        for i, piece in enumerate(pieces):
            last = end and i == len(pieces) - 1
            await self.call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=piece, end_of_stream=last)))
            if (self.mode != "full-duplex" and not last and end
                    and (await self._read()).WhichOneof("response") == "immediate_response"):
                return self.answer
        if not end:
            return self.answer
        while True:
            r = await self._read()
            kind = r.WhichOneof("response")
            if kind == "immediate_response" or kind == "request_body":
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
            await self._read()

    async def close(self) -> None:
        await self.call.done_writing()


class GatewayClient:
    """ext_proc streams to one endpoint picker, as a gateway opens them (one per HTTP request)."""

    def __init__(self, target: str) -> None:
        self.channel = dial_aio(target)
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
        if exc[0] is None:
            await self.ex.close()
        self.ex.call.cancel()
