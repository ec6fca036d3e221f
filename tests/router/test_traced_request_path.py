"""The request path's spans (router/request/traced.py, pipeline.py) with fake workers and index, tracing on in
this process: the client spans carry OpenTelemetry's RPC conventions and their calls' status, the request's
span its outcome, and the caller's ``tracestate`` goes on to the worker with the ``traceparent``."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.contract.errors import Unavailable
from kvmesh.contract.types import SamplingParams, TraceContext, Usage
from kvmesh.router.config import RouterConfig, RoutingConfig
from kvmesh.router.core.policies.base import PolicyConfig
from kvmesh.router.core.upstream import Failure, WorkerChunk, WorkerError
from kvmesh.router.generate_types import GenerateInput
from kvmesh.router.model_router import ModelRouter
from tests.support.router import FakeIndex, FakePool, collect
from tests.support.tracing import spans_named, tracing_in_memory

PROMPT = list(range(1, 33))
TRACE_ID = "ab" * 16
PARENT = TraceContext(f"00-{TRACE_ID}-{'cd' * 8}-01", "vendor=x,other=y")


class _Pool(FakePool):
    """Keeps the requests as the workers get them."""

    def generate(self, endpoint, request, timeout_s):  # type: ignore[no-untyped-def]
        self.sent = [*getattr(self, "sent", []), request]
        return super().generate(endpoint, request, timeout_s)


def ok(wid: str) -> list:
    return [WorkerChunk([7]), WorkerChunk([8], "length", Usage(32, 16, 2), wid)]


def run(scripts: dict[str, list], index: FakeIndex) -> tuple[list, _Pool]:
    pool = _Pool(scripts)
    router = ModelRouter(RouterConfig(routing=RoutingConfig(policy_config=PolicyConfig(seed=0))), pool, index)
    inp = GenerateInput(None, PROMPT, SamplingParams(max_tokens=2), trace=PARENT)
    return asyncio.run(collect(router.generate(inp))), pool


def test_tracestate_travels_with_traceparent_to_the_worker(monkeypatch):
    spans = tracing_in_memory(monkeypatch)
    pool = run({"w1": ok("w1")}, FakeIndex({"w1": 8}))[1]
    (request,) = pool.sent
    forward = spans_named(spans, "router.forward")[-1]
    assert request.trace == TraceContext(f"00-{TRACE_ID}-{forward.context.span_id:016x}-01", "vendor=x,other=y")


def test_client_spans_carry_the_rpc_conventions_and_their_status(monkeypatch):
    spans = tracing_in_memory(monkeypatch)
    out, _ = run({"w1": [WorkerError(Failure.UNAVAILABLE, "UNAVAILABLE: gone")], "w2": ok("w2")},
                 FakeIndex({"w1": 8}))
    assert out[-1].finish_reason == "length"
    failed, answered = spans_named(spans, "router.forward")
    for span in (failed, answered):
        assert span.kind.name == "CLIENT"
        assert {k: span.attributes[k] for k in ("rpc.system", "rpc.service", "rpc.method", "server.port")} == {
            "rpc.system": "grpc", "rpc.service": "kvmesh.v1.Worker", "rpc.method": "Generate", "server.port": 1}
    assert failed.attributes["server.address"] == "w1" and answered.attributes["server.address"] == "w2"
    assert failed.status.status_code.name == "ERROR" and failed.attributes["rpc.grpc.status_code"] == 14
    assert failed.attributes["error.type"] == "WorkerError"
    assert answered.status.status_code.name == "UNSET" and answered.attributes["rpc.grpc.status_code"] == 0
    (lookup,) = spans_named(spans, "router.lookup")
    assert lookup.kind.name == "CLIENT" and lookup.attributes["rpc.method"] == "Lookup"
    assert lookup.attributes["rpc.service"] == "kvmesh.v1.KVService" and lookup.attributes["rpc.grpc.status_code"] == 0
    (request,) = spans_named(spans, "router.request")
    assert request.kind.name == "SERVER" and request.status.status_code.name == "OK"


def test_a_request_that_fails_ends_its_span_with_error_status(monkeypatch):
    spans = tracing_in_memory(monkeypatch)
    with pytest.raises(Unavailable):
        run({"w1": [WorkerError(Failure.UNAVAILABLE, "UNAVAILABLE: gone")]}, FakeIndex(down=True))
    (request,) = spans_named(spans, "router.request")
    assert request.status.status_code.name == "ERROR" and request.attributes["error.type"] == "Unavailable"
    (lookup,) = spans_named(spans, "router.lookup")
    assert lookup.status.status_code.name == "ERROR" and lookup.attributes["rpc.grpc.status_code"] == 2
