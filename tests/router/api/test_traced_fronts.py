"""Every request the router's fronts take has a trace, refusals included (issue 50): the ``router.request``
span opens before the request is checked, carries OpenTelemetry's HTTP or RPC conventions and ends with
the request's status (docs/tracing.md). Tracing on in this process, its spans in memory."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from kvmesh.contract.errors import NotFound
from kvmesh.contract.types import Usage
from kvmesh.router.api.body_bounds import BodyBounds
from kvmesh.router.api.frontend import Frontend
from kvmesh.router.api.grpc_api import RouterServicer
from kvmesh.router.api.openai_api import OpenAIApi
from kvmesh.router.config import RouterConfig
from kvmesh.router.generate_types import GenerateInput, GenerateOutput
from kvmesh.router.metrics import RouterMetrics
from kvmesh.v1 import common_pb2, router_pb2
from tests.support.asgi import asgi_call
from tests.support.tracing import spans_named, tracing_in_memory

PARENT = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"


class _Model:
    model_id = "m"

    @property
    def router(self) -> _Model:
        return self

    def request_id_for(self, inp: GenerateInput) -> str:
        return inp.request_id or "rid"


class _Frontend(Frontend):
    """One served model, ``m``, whose request path answers two tokens at once; it sees the front's span."""

    def __init__(self) -> None:
        super().__init__(None, 8, RouterMetrics())  # type: ignore[arg-type]
        self.spans: list[Any] = []

    def body_bounds(self, config: RouterConfig) -> BodyBounds:
        return BodyBounds(config.max_body_bytes, config.max_messages, config.max_content_parts, 64, 4096)

    def model(self, name: str) -> Any:
        if name not in ("", "m"):
            raise NotFound(f"model {name!r} is not served")
        return _Model()

    def target(self, name: str) -> tuple[Any, str]:
        return self.model(name), ""

    async def generate(self, model: Any, inp: GenerateInput, request_id: str | None = None,
                       span: Any = None) -> AsyncIterator[GenerateOutput]:
        self.spans.append(span)
        yield GenerateOutput([7], "he", None, None, "w0", inp.request_id)
        yield GenerateOutput([8], "llo", "length", Usage(3, 1, 2), "w0")


async def _post(app: Any, path: str, body: bytes) -> int:
    start, _, _ = await asgi_call(app, "POST", path, {"content-type": "application/json", "traceparent": PARENT}, [body])
    return start["status"]


@pytest.mark.parametrize(("body", "status", "error_type"), [
    (json.dumps({"model": "nope", "prompt": "hi"}).encode(), 404, "NotFound"),
    (b'{"prompt": "hi", ', 400, "InvalidArgument"),
    (json.dumps({"prompt": "hi", "n": 2}).encode(), 400, "InvalidArgument"),
    (json.dumps({"prompt": "hi", "max_tokens": 0}).encode(), 400, "InvalidArgument"),
], ids=["unknown-model", "bad-json", "n=2", "max_tokens=0"])
def test_a_refused_http_request_has_its_span_with_error_status(monkeypatch, body, status, error_type):
    spans = tracing_in_memory(monkeypatch)
    api = OpenAIApi(_Frontend())
    assert asyncio.run(_post(api.app, "/v1/completions", body)) == status
    (span,) = spans_named(spans, "router.request")
    assert span.status.status_code.name == "ERROR" and span.status.description
    assert span.attributes["http.response.status_code"] == status
    assert span.attributes["error.type"] == error_type
    assert span.parent is not None and span.parent.span_id == int("cd" * 8, 16)  # under the caller's span
    assert any(e.name == "exception" for e in span.events)


@pytest.mark.parametrize("stream", [False, True])
def test_an_answered_http_request_has_the_http_conventions_and_ok_status(monkeypatch, stream):
    spans = tracing_in_memory(monkeypatch)
    frontend = _Frontend()
    api = OpenAIApi(frontend)
    body = json.dumps({"prompt": "hi", "max_tokens": 2, "stream": stream}).encode()
    assert asyncio.run(_post(api.app, "/v1/completions", body)) == 200
    (span,) = spans_named(spans, "router.request")
    assert [s.get_span_context() for s in frontend.spans] == [span.context]  # the request path's span
    assert span.kind.name == "SERVER" and span.status.status_code.name == "OK"
    assert {k: span.attributes[k] for k in ("http.request.method", "url.path", "http.route", "url.scheme",
                                            "http.response.status_code")} == {
        "http.request.method": "POST", "url.path": "/v1/completions", "http.route": "/v1/completions",
        "url.scheme": "http", "http.response.status_code": 200}


class _Context:
    """What RouterServicer.Generate reads of a gRPC call."""

    def __init__(self) -> None:
        self.trailers: Any = ()

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("traceparent", PARENT), ("tracestate", "vendor=x"))

    def time_remaining(self) -> None:
        return None

    def set_trailing_metadata(self, md: Any) -> None:
        self.trailers = md


async def _generate(servicer: RouterServicer, request: router_pb2.GenerateRequest) -> list[Any]:
    return [m async for m in servicer.Generate(request, _Context())]


RPC = {"rpc.system": "grpc", "rpc.service": "kvmesh.v1.Router", "rpc.method": "Generate"}


@pytest.mark.parametrize(("request_", "code", "error_type"), [
    (router_pb2.GenerateRequest(model="nope", text="hi"), 5, "NotFound"),
    (router_pb2.GenerateRequest(text="hi", stop=["s"] * 1000), 3, "InvalidArgument"),
], ids=["NOT_FOUND", "INVALID_ARGUMENT"])
def test_a_refused_grpc_request_has_its_span_with_error_status(monkeypatch, request_, code, error_type):
    spans = tracing_in_memory(monkeypatch)
    with pytest.raises(Exception, match="nope|stop"):
        asyncio.run(_generate(RouterServicer(_Frontend(), RouterConfig()), request_))
    (span,) = spans_named(spans, "router.request")
    assert span.kind.name == "SERVER" and span.status.status_code.name == "ERROR"
    assert {k: span.attributes.get(k) for k in RPC} == RPC
    assert span.attributes["rpc.grpc.status_code"] == code
    assert span.attributes["error.type"] == error_type
    assert span.parent is not None and span.parent.span_id == int("cd" * 8, 16)


def test_an_answered_grpc_request_has_the_rpc_conventions_and_ok_status(monkeypatch):
    spans = tracing_in_memory(monkeypatch)
    out = asyncio.run(_generate(RouterServicer(_Frontend(), RouterConfig()), router_pb2.GenerateRequest(
        text="hi", sampling=common_pb2.SamplingParams(max_tokens=2))))
    assert out[-1].finish_reason
    (span,) = spans_named(spans, "router.request")
    assert span.status.status_code.name == "OK"
    assert {k: span.attributes.get(k) for k in RPC} == RPC and span.attributes["rpc.grpc.status_code"] == 0
    assert span.context.trace_state.get("vendor") == "x"  # the caller's tracestate goes on with the trace
