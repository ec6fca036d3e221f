"""`kvmesh epp`'s protocol: Envoy's ext_proc v3 ``ExternalProcessor.Process`` stream, as the Gateway
API Inference Extension's endpoint picker protocol (its proposal 004) uses it (docs/epp.md).

One stream per HTTP request. What arrives, and what this adapter answers:

- ``request_headers``: the path, ``x-request-id``, ``traceparent``, and in ``metadata_context`` the
  gateway's subset hint (``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset``). With a
  body coming, FULL_DUPLEX_STREAMED (the protocol's mode) holds the answer until the body is read;
  BUFFERED lets the headers through at once. A request without a body is answered here.
- ``request_body`` (FULL_DUPLEX_STREAMED: in chunks, the last with ``end_of_stream``; BUFFERED: whole,
  in one message): parsed as it arrives; at its end the pick goes out as the header
  ``x-gateway-destination-endpoint: ip:port[,fallback,...]`` and the same value in the dynamic metadata
  namespace ``envoy.lb``; in FULL_DUPLEX_STREAMED the body is sent back unchanged after the headers'
  answer, in pieces of at most :data:`ECHO_PIECE_BYTES`, in BUFFERED the mutation rides on the body's answer.
- ``request_trailers``: a body that has trailers ends with them instead of ``end_of_stream``
  (FULL_DUPLEX_STREAMED: the pick and the body's echo go out first, the echo's last piece without
  ``end_of_stream``); answered with a ``TrailersResponse``.
- A refusal (a bad body, a model not served, no ready endpoint, shedding) is an ``immediate_response``
  with the status and an OpenAI JSON error, and ends the stream.
- ``response_headers`` / ``response_body`` / ``response_trailers``: let through unchanged (echoed in
  FULL_DUPLEX_STREAMED); the served endpoint (``envoy.lb`` / ``x-gateway-destination-endpoint-served``),
  the first byte and the usage at the end (``end_of_stream`` or the trailers) feed the router's in-flight
  view and miss audit.

router/api/gateway.py holds the life cycle; this module only converts messages.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvmesh.router.api.frontend import Frontend
from kvmesh.router.api.gateway import GatewayRequest, Pick, Refusal
from kvmesh.router.config import EppConfig, RouterConfig

log = logging.getLogger("kvmesh.epp")

SERVICE_NAME = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
ECHO_PIECE_BYTES = 64 * 1024
"""The most body one streamed answer carries: Envoy's processing_mode.proto recommends at most 64K per
FULL_DUPLEX_STREAMED response chunk, and a whole body in one message breaks a receiver at gRPC's default
4 MiB limit."""
FRAMING_HEADROOM_BYTES = 1024 * 1024
"""What the server takes in one message beyond ``--max-body-bytes``: a BUFFERED body comes as one
ProcessingRequest, with its framing (and whatever metadata Envoy sends beside it) on top; a body over the
limit by less than this gets the picker's 413, one further over gRPC's RESOURCE_EXHAUSTED."""
_MODES = processing_mode_pb2.ProcessingMode
_FULL_DUPLEX = _MODES.FULL_DUPLEX_STREAMED
_BUFFERED = _MODES.BUFFERED


def headers_of(h: base_pb2.HeaderMap) -> dict[str, str]:
    """A HeaderMap as a dict of lower-case names (``raw_value`` as Envoy sends it, else ``value``)."""
    return {x.key.lower(): (x.raw_value.decode("latin-1") if x.raw_value else x.value) for x in h.headers}


def _struct_strings(md: base_pb2.Metadata, namespace: str, key: str) -> list[str] | None:
    """The string list (or comma-separated string) at ``namespace`` / ``key`` of the filter metadata."""
    ns = md.filter_metadata.get(namespace) if md.filter_metadata else None
    if ns is None or key not in ns.fields:
        return None
    v = ns.fields[key]
    kind = v.WhichOneof("kind")
    if kind == "list_value":
        return [x.string_value.strip() for x in v.list_value.values if x.string_value.strip()]
    if kind == "string_value":
        return [x.strip() for x in v.string_value.split(",") if x.strip()]
    return []


def max_receive_bytes(max_body_bytes: int) -> int:
    """The gRPC receive limit of a picker that takes bodies up to ``max_body_bytes``."""
    return max_body_bytes + FRAMING_HEADROOM_BYTES


def _streamed(body: bytes, end_of_stream: bool, request: bool) -> Iterator[ep.ProcessingResponse]:
    """``body`` sent back in FULL_DUPLEX_STREAMED, in pieces of at most ECHO_PIECE_BYTES (an empty body is
    one empty piece); ``end_of_stream`` on the last."""
    n = len(body)
    for at in range(0, max(n, 1), ECHO_PIECE_BYTES):
        piece = body if n <= ECHO_PIECE_BYTES else body[at:at + ECHO_PIECE_BYTES]
        last = at + ECHO_PIECE_BYTES >= n
        mutation = ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(body=piece, end_of_stream=end_of_stream and last))
        answer = ep.BodyResponse(response=ep.CommonResponse(body_mutation=mutation))
        yield ep.ProcessingResponse(request_body=answer) if request else ep.ProcessingResponse(response_body=answer)


def _set_headers(values: Mapping[str, str]) -> ep.HeaderMutation:
    return ep.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                                   append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
        for k, v in values.items()])


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    """Args:
    frontend: what every front of the router calls (models, the stream limit, metrics).
    config: the router's flags; epp: the endpoint picker's.
    """

    def __init__(self, frontend: Frontend, config: RouterConfig, epp: EppConfig) -> None:
        self.frontend = frontend
        self.config = config
        self.epp = epp
        self._default_full_duplex = epp.request_body_mode == "full-duplex"

    # -- answers ---------------------------------------------------------------------------------
    def _pick_parts(self, pick: Pick) -> tuple[ep.CommonResponse, struct_pb2.Struct]:
        value = pick.value
        common = ep.CommonResponse(header_mutation=_set_headers({self.epp.destination_header: value, **pick.headers}),
                                   clear_route_cache=True)
        md = struct_pb2.Struct()
        md.get_or_create_struct(self.epp.metadata_namespace)[self.epp.destination_header] = value
        return common, md

    def _picked(self, pick: Pick, full_duplex: bool, held: list[bytes], end_of_stream: bool
                ) -> Iterator[ep.ProcessingResponse]:
        """The pick's answers. FULL_DUPLEX_STREAMED: the headers' answer, then the body sent back
        (``end_of_stream`` False when trailers follow); BUFFERED: the body's answer."""
        common, md = self._pick_parts(pick)
        if not full_duplex:
            yield ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=md)
            return
        yield ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common), dynamic_metadata=md)
        yield from _streamed(b"".join(held), end_of_stream, request=True)

    @staticmethod
    def _immediate(refusal: Refusal) -> ep.ProcessingResponse:
        return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=refusal.status), body=refusal.body,
            headers=_set_headers({"content-type": "application/json"}),
            details=f"kvmesh_epp_{refusal.status}"))

    # -- the stream ------------------------------------------------------------------------------
    async def Process(self, requests: AsyncIterator[ep.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[ep.ProcessingResponse]:
        g = GatewayRequest(self.frontend, self.config, self.epp)
        full_duplex = response_full_duplex = self._default_full_duplex
        held: list[bytes] = []
        """FULL_DUPLEX_STREAMED: the body's chunks, sent back after the headers' answer."""
        try:
            async for req in requests:
                kind = req.WhichOneof("request")
                if req.HasField("protocol_config"):
                    mode = req.protocol_config.request_body_mode
                    if mode not in (_FULL_DUPLEX, _BUFFERED, _MODES.NONE):
                        yield self._immediate(Refusal(500, (
                            b'{"error":{"message":"kvmesh epp takes request bodies in FULL_DUPLEX_STREAMED or '
                            b'BUFFERED mode (the gateway\'s ext_proc processing_mode)","type":"server_error",'
                            b'"param":null,"code":null}}')))
                        return
                    full_duplex = mode == _FULL_DUPLEX if mode != _MODES.NONE else full_duplex
                    response_full_duplex = req.protocol_config.response_body_mode == _FULL_DUPLEX
                if kind == "request_headers":
                    rh = req.request_headers
                    subset = _struct_strings(req.metadata_context, self.epp.subset_namespace, SUBSET_KEY)
                    result = g.on_headers(headers_of(rh.headers), subset, rh.end_of_stream)
                    if isinstance(result, Refusal):
                        yield self._immediate(result)
                        return
                    if isinstance(result, Pick):
                        common, md = self._pick_parts(result)
                        yield ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common),
                                                    dynamic_metadata=md)
                    elif not full_duplex:
                        yield ep.ProcessingResponse(request_headers=ep.HeadersResponse())
                elif kind == "request_body":
                    rb = req.request_body
                    if full_duplex:
                        held.append(rb.body)
                    # NOTE: BUFFERED sends the whole body in one message; its end_of_stream is false when
                    # trailers follow, and Envoy sends those only when its trailer mode says SEND.
                    result = await g.on_body(rb.body, rb.end_of_stream or not full_duplex)
                    if isinstance(result, Refusal):
                        yield self._immediate(result)
                        return
                    if result is None:
                        if not full_duplex:
                            yield ep.ProcessingResponse(request_body=ep.BodyResponse())
                        continue
                    for answer in self._picked(result, full_duplex, held, end_of_stream=True):
                        yield answer
                    held = []
                elif kind == "request_trailers":
                    result = await g.on_body(b"", True)  # the end of a body sent without end_of_stream
                    if isinstance(result, Refusal):
                        yield self._immediate(result)
                        return
                    if result is not None:
                        for answer in self._picked(result, full_duplex, held, end_of_stream=False):
                            yield answer
                        held = []
                    yield ep.ProcessingResponse(request_trailers=ep.TrailersResponse())
                elif kind in ("response_headers", "response_body"):
                    served = _struct_strings(req.metadata_context, self.epp.metadata_namespace, SERVED_KEY)
                    if served:
                        g.on_served(served[0])
                if kind == "response_headers":
                    g.on_response_headers(headers_of(req.response_headers.headers))
                    yield ep.ProcessingResponse(response_headers=ep.HeadersResponse())
                    if req.response_headers.end_of_stream:
                        g.on_response_body(b"", True)
                elif kind == "response_body":
                    rb = req.response_body
                    g.on_response_body(rb.body, rb.end_of_stream)
                    if response_full_duplex:
                        for answer in _streamed(rb.body, rb.end_of_stream, request=False):
                            yield answer
                    else:
                        yield ep.ProcessingResponse(response_body=ep.BodyResponse())
                elif kind == "response_trailers":
                    g.on_response_body(b"", True)  # a response with trailers ends with them
                    yield ep.ProcessingResponse(response_trailers=ep.TrailersResponse())
        finally:
            g.close()


def add_to_server(server: Any, frontend: Frontend, config: RouterConfig, epp: EppConfig) -> None:
    ep_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(frontend, config, epp), server)


def subset_metadata(endpoints: Sequence[str], namespace: str = "envoy.lb.subset_hint") -> base_pb2.Metadata:
    """The filter metadata of a subset hint, as a gateway sends it (tests, benchmarks)."""
    md = base_pb2.Metadata()
    s = md.filter_metadata[namespace]
    s.fields[SUBSET_KEY].list_value.values.extend([struct_pb2.Value(string_value=e) for e in endpoints])
    return md
