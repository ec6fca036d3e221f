"""router/api/gateway.py without a gateway: one request's exchange (headers, body, pick) on a router over two
static workers and no index."""

from __future__ import annotations

import asyncio
import json

from kvmesh.contract.types import Load, ModelSpec
from kvmesh.router.api.frontend import Frontend
from kvmesh.router.api.gateway import GatewayRequest, Pick
from kvmesh.router.config import EppConfig, RouterConfig
from kvmesh.router.core.upstream import WorkerEndpoint
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.models import ModelSet
from tests.support.tracing import spans_named, tracing_in_memory

MODEL = "m"


class StaticPool:
    """Two idle workers, always healthy."""

    discovers_from_index = False
    problem = ""

    def endpoints(self) -> list[WorkerEndpoint]:
        return [WorkerEndpoint(w, f"{w}.mesh:8000", Load(num_free_blocks=100, num_total_blocks=100))
                for w in ("w0", "w1")]

    def model_spec(self) -> ModelSpec:
        return ModelSpec(MODEL, 4, "sha256_128")

    def healthy(self, worker_id: str) -> bool:
        return True

    def mark_unhealthy(self, worker_id: str) -> None:
        pass


def test_the_pick_carries_the_pickers_traceparent(monkeypatch):
    """Catches the picker's trace injection removed (issue 50): with tracing on, the headers the pick sets
    carry a ``traceparent`` of the picker's own span (``epp.request``, in the caller's trace), so the engine's
    spans join the trace under the pick."""
    spans = tracing_in_memory(monkeypatch)
    config = RouterConfig(model_id=MODEL)
    frontend = Frontend(ModelSet(config, lambda _m: StaticPool(), None, RouterMetrics()), 100, RouterMetrics())
    caller = f"00-{'ab' * 16}-{'cd' * 8}-01"

    async def pick() -> Pick:
        g = GatewayRequest(frontend, config, EppConfig())
        assert g.on_headers({":path": "/v1/completions", "x-request-id": "r1", "traceparent": caller}, None,
                            False) is None
        p = await g.on_body(json.dumps({"model": MODEL, "prompt": list(range(3, 40)), "max_tokens": 2}).encode(), True)
        g.close()
        assert isinstance(p, Pick), p
        return p

    p = asyncio.run(pick())
    (epp,) = spans_named(spans, "epp.request")
    version, trace_id, span_id, _flags = p.headers["traceparent"].split("-")
    assert (trace_id, span_id) == (f"{epp.context.trace_id:032x}", f"{epp.context.span_id:016x}")
    assert trace_id == "ab" * 16 and epp.parent is not None and epp.parent.span_id == int("cd" * 8, 16)
