"""Latency objectives on a real stack (docs/router.md, "Latency objectives"; issue 51): Redis, kv_service, a
tiny-model worker, routers and an endpoint picker with ``--slo-refuse``.

kv-aware judges an objective only once it has learned the worker's step cost from the loads its Lookups
carry, so each front first routes requests of several lengths until its policy has. A TTFT objective of
1 microsecond is then impossible; ten minutes is always met.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from kvmesh.router.server import RouterServer
from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.support import wait_until
from tests.support.epp import COMPLETIONS, ids_body, pick

IMPOSSIBLE = "0.001"
FEASIBLE = "600000"


def generate(router: RouterServer, ids: list[int], **fields: Any) -> list[router_pb2.GenerateResponse]:
    stub = router_pb2_grpc.RouterStub(dial(f"127.0.0.1:{router.port}"))
    return list(stub.Generate(router_pb2.GenerateRequest(
        token_ids=router_pb2.TokenIds(ids=ids), sampling=common_pb2.SamplingParams(max_tokens=2, ignore_eos=True),
        **fields), timeout=60))


def warm(router: RouterServer, also: Callable[[list[int]], None] = lambda _ids: None, **fields: Any) -> None:
    """Requests of several lengths (so the fit tells a prefill token from a step) until kv-aware has learned
    the worker's step cost; ``also(ids)`` after each (another front's pick, to learn from the same loads)."""
    learner = router.router.policy.cost
    for k in range(40):
        ids = [(7 * k + i) % 300 + 3 for i in range(16 + 9 * (k % 6))]
        generate(router, ids, **fields)
        also(ids)
        if learner.learned and k >= 12:
            return
    raise AssertionError(f"the router never learned the step cost ({learner.reports} reports)")


def post(router: RouterServer, headers: dict[str, str], ids: list[int] | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{router.http_port}/v1/completions",
                                 data=json.dumps(ids_body(ids or [5, 6, 7, 8] * 8, max_tokens=2)).encode(),
                                 headers={"content-type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def refusals(router: RouterServer) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{router.http_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvmesh_router_slo_refusals_total{"):
            label, value = line.split(" ")
            out[label.split('"')[1]] = float(value)
    return out


@pytest.fixture
def refusing(kv_server, start_worker, start_router, start_epp):
    """A worker, a router (gRPC and HTTP) and an endpoint picker, both with --slo-refuse, both taught."""
    kv = f"127.0.0.1:{kv_server.port}"
    start_worker("w0", kv)
    router = start_router(kv, router_kw={"http_port": 0, "slo_refuse": True})
    epp = start_epp(kv, router_kw={"slo_refuse": True})
    warm(router, also=lambda ids: pick(epp.port, COMPLETIONS, ids_body(ids)))
    wait_until(lambda: epp.router.policy.cost.learned, 1, "the picker to learn the step cost")
    return router, epp


def test_http_headers_are_served_when_feasible_refused_with_429_when_not_and_400_when_bad(refusing):
    router, _ = refusing
    status, body = post(router, {"x-slo-ttft-ms": FEASIBLE, "x-slo-tpot-ms": FEASIBLE})
    assert status == 200, body
    assert body["choices"][0]["text"] is not None
    status, body = post(router, {"x-slo-ttft-ms": IMPOSSIBLE})
    assert status == 429, body
    message = body["error"]["message"]
    assert message.startswith("no worker is predicted to meet the request's TTFT objective of 0.001 ms (the best "
                              "predicted is "), message
    assert message.endswith("(--slo-refuse)")
    status, body = post(router, {"x-slo-tpot-ms": "0.000001"})
    assert status == 429 and "TPOT objective of 1e-06 ms" in body["error"]["message"], body
    assert refusals(router) == {"ttft": 1.0, "tpot": 1.0}
    for bad, why in (("abc", "must be a number"), ("-5", "must be in [0, 3.6e+06]"), ("1e12", "must be in"),
                     ("nan", "must be in")):
        status, body = post(router, {"x-slo-ttft-ms": bad})
        assert status == 400 and body["error"]["message"].startswith("x-slo-ttft-ms " + why), (bad, body)
    status, body = post(router, {"x-slo-tpot-ms": "fast"})
    assert status == 400 and body["error"]["message"].startswith("x-slo-tpot-ms must be a number"), body
    assert refusals(router) == {"ttft": 1.0, "tpot": 1.0}
    # 0 = no objective: served
    assert post(router, {"x-slo-ttft-ms": "0"})[0] == 200


def test_grpc_fields_refuse_with_resource_exhausted_and_reject_bad_values(refusing):
    router, _ = refusing
    ids = [9, 10, 11, 12] * 8
    assert generate(router, ids, slo_ttft_ms=600_000.0, slo_tpot_ms=600_000.0)[-1].finish_reason
    with pytest.raises(grpc.RpcError) as err:
        generate(router, ids, slo_ttft_ms=0.001)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "TTFT objective of 0.001 ms" in err.value.details()
    for bad in (-1.0, float("inf")):
        with pytest.raises(grpc.RpcError) as err:
            generate(router, ids, slo_tpot_ms=bad)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("slo_tpot_ms must be in"), err.value.details()


def test_the_picker_reads_the_gateways_headers_and_answers_429(refusing):
    _, epp = refusing
    body = ids_body([13, 14, 15, 16] * 8)
    answer = pick(epp.port, COMPLETIONS, body, headers={"x-slo-ttft-ms": FEASIBLE})
    assert answer.status is None and answer.endpoints, answer.error
    answer = pick(epp.port, COMPLETIONS, body, headers={"x-slo-ttft-ms": IMPOSSIBLE})
    assert answer.status == 429 and "TTFT objective of 0.001 ms" in answer.error["error"]["message"], answer
    answer = pick(epp.port, COMPLETIONS, body, headers={"x-slo-tpot-ms": "soon"})
    assert answer.status == 400 and "x-slo-tpot-ms" in answer.error["error"]["message"], answer
    assert epp.router.metrics.slo_refusals.labels("ttft")._value.get() == 1


def test_the_default_flag_applies_to_a_request_that_names_no_objective(kv_server, start_worker, start_router):
    kv = f"127.0.0.1:{kv_server.port}"
    start_worker("w0", kv)
    router = start_router(kv, router_kw={"http_port": 0, "slo_refuse": True, "slo_ttft_ms": 0.001})
    warm(router, slo_ttft_ms=0.0)  # 0 = none, the default overridden
    status, body = post(router, {})
    assert status == 429 and "TTFT objective of 0.001 ms" in body["error"]["message"], body
    with pytest.raises(grpc.RpcError) as err:
        generate(router, [1, 2, 3, 4] * 8)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert post(router, {"x-slo-ttft-ms": FEASIBLE})[0] == 200
    assert refusals(router) == {"ttft": 2.0}


def test_without_slo_refuse_an_impossible_objective_is_served(kv_server, start_worker, start_router):
    kv = f"127.0.0.1:{kv_server.port}"
    start_worker("w0", kv)
    router = start_router(kv, router_kw={"http_port": 0})
    warm(router)
    assert post(router, {"x-slo-ttft-ms": IMPOSSIBLE})[0] == 200
    assert refusals(router) == {}
