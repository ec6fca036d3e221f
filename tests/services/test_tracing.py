"""One trace per request across processes: a stack (router, kv_service, worker, each its own process,
`kvmesh up`'s LocalStack) exporting to a real OTLP receiver in this process (kvmesh/bench/otlp_receiver.py).
The client's own ``traceparent`` is the trace's root; every request's spans arrive from the three
services, each under its caller's, in the order the request went."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvmesh.bench.otlp_receiver import OtlpReceiver
from kvmesh.loopback import free_port, free_port_run
from kvmesh.stack import LocalStack, StackConfig
from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc

TRACE_IDS = [f"{i + 1:032x}" for i in range(8)]
SERVICES = {"kvmesh-router", "kvmesh-kv-service", "kvmesh-worker"}


@pytest.fixture(scope="module")
def traced(model_dir, tmp_path_factory) -> Iterator[tuple[OtlpReceiver, LocalStack]]:
    with OtlpReceiver() as receiver:
        cfg = StackConfig(model=str(model_dir), workers=1, router_port=free_port(), kv_service_port=free_port(),
                          worker_port=free_port(), metrics_port=free_port_run(3), http_port=free_port(),
                          log_dir=str(tmp_path_factory.mktemp("traced-logs")), otlp_endpoint=receiver.address,
                          worker_args=["--num-blocks=128", "--max-model-len=512", "--torch-threads=1"],
                          router_args=["--discovery-interval=0.2"])
        stack = LocalStack(cfg).start()
        try:
            yield receiver, stack
        finally:
            stack.stop()


def complete(receiver: OtlpReceiver, trace_ids: list[str], timeout: float = 20.0) -> dict:
    """The traces once each holds spans of the three services, the worker's last and the router's root
    (the exporters batch every 0.2 s; the root ends after the client's last message, so a loaded host
    can export it a batch after the rest)."""
    deadline = time.monotonic() + timeout
    while True:
        traces = receiver.traces()
        done = {t: traces.get(t, []) for t in trace_ids}
        if all({s.service for s in spans} >= SERVICES and {"worker.finish", "router.request"} <= {s.name for s in spans}
               for spans in done.values()) or time.monotonic() > deadline:
            return done
        time.sleep(0.1)


def test_every_request_is_one_trace_across_router_kv_service_and_worker_in_order(traced):
    receiver, stack = traced
    stub = router_pb2_grpc.RouterStub(dial(stack.endpoints["router"]))
    for i, trace_id in enumerate(TRACE_IDS):
        parent = f"00-{trace_id}-{i + 1:016x}-01"
        ids = [(7 * i + k) % 200 + 3 for k in range(48)]  # three full blocks: the router asks the index
        out = list(stub.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                                            sampling=common_pb2.SamplingParams(max_tokens=20)),
                                 metadata=(("traceparent", parent),), timeout=60))
        assert out[-1].finish_reason
    traces = complete(receiver, TRACE_IDS)
    for i, trace_id in enumerate(TRACE_IDS):
        spans = traces[trace_id]
        assert {s.service for s in spans} >= SERVICES, (trace_id, [(s.service, s.name) for s in spans])
        by_name = {s.name: s for s in spans}
        by_id = {s.span_id: s for s in spans}
        root = by_name["router.request"]
        assert root.parent_id == f"{i + 1:016x}"  # under the client's own span
        lookup, kv, forward, worker = (by_name[n] for n in ("router.lookup", "kv.lookup", "router.forward",
                                                            "worker.generate"))
        # each callee's span hangs under its caller's
        assert by_id[kv.parent_id].name == "router.lookup"
        assert by_id[worker.parent_id].name == "router.forward"
        assert by_id[forward.parent_id].name == "router.request"
        assert by_id[lookup.parent_id].name == "router.request"
        if "kv.reserve" in by_name:
            assert by_id[by_name["kv.reserve"].parent_id].name == "router.reserve"
        # in the order the request went: render/tokenize, hash, Lookup, pick, (Reserve,) forward; then the worker
        order = [by_name[n].start_ns for n in ("router.tokenize", "router.hash", "router.lookup", "router.pick")]
        assert order == sorted(order)
        assert lookup.start_ns <= kv.start_ns and kv.end_ns <= lookup.end_ns + 5_000_000  # clocks of one host
        assert by_name["router.pick"].end_ns <= forward.start_ns <= worker.start_ns
        worker_parts = [s for s in spans if s.service == "kvmesh-worker" and s.parent_id == worker.span_id]
        names = [s.name for s in sorted(worker_parts, key=lambda s: (s.start_ns, s.end_ns))]
        assert names[0] == "worker.queue" and names[-1] == "worker.finish"
        assert "worker.prefill" in names and "worker.first_token" in names and "worker.decode" in names
        assert names.index("worker.first_token") > names.index("worker.prefill")
        assert sum(s.attributes.get("kvmesh.tokens", 0) for s in worker_parts if s.name == "worker.prefill") == 48


def test_an_openai_http_request_joins_the_callers_trace(traced):
    """The W3C header of an HTTP client (or of a gateway in front) is the trace's root, as gRPC metadata is."""
    import json
    import urllib.request

    receiver, stack = traced
    trace_id = "ab" * 16
    req = urllib.request.Request(f"{stack.endpoints['openai']}/completions",
                                 data=json.dumps({"prompt": list(range(3, 51)), "max_tokens": 3}).encode(),
                                 headers={"content-type": "application/json",
                                          "traceparent": f"00-{trace_id}-{'cd' * 8}-01"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200
    spans = complete(receiver, [trace_id])[trace_id]
    assert {s.service for s in spans} >= SERVICES
    root = next(s for s in spans if s.name == "router.request")
    assert root.parent_id == "cd" * 8


def test_the_kv_services_reserve_span_hangs_under_the_routers(monkeypatch):
    """Catches the traceparent dropped on Reserve (issue 50): the kv_service client sends the router's
    context as gRPC metadata on Reserve as on Lookup, so ``kv.reserve`` is a child of ``router.reserve``
    in the router's trace, not the root of a trace of its own. A real kv_service (memory store), in this
    process, tracing on with its spans in memory."""
    import asyncio

    from kvmesh.contract.index_protocol import Reservation
    from kvmesh.kv_client.router_client import KVServiceClient
    from kvmesh.kv_service.server import KVServiceServer
    from kvmesh.kv_service.store_memory import MemoryIndex
    from kvmesh.router.request.traced import TracedIndex
    from kvmesh.v1 import kv_service_pb2 as kv_pb
    from kvmesh.v1 import kv_service_pb2_grpc as kv_grpc
    from tests.support.tracing import spans_named, tracing_in_memory

    spans = tracing_in_memory(monkeypatch)
    server = KVServiceServer(MemoryIndex(), "127.0.0.1", free_port()).start()
    try:
        kv_grpc.KVServiceStub(dial(f"127.0.0.1:{server.port}")).RegisterWorker(kv_pb.RegisterWorkerRequest(
            worker_id="w1", address="127.0.0.1:1", model_id="m", block_size=4,
            hash_algorithm=kv_pb.HASH_ALGORITHM_SHA256_128, num_blocks=100, epoch=1), timeout=5)

        async def reserve() -> bool:
            client = KVServiceClient(f"127.0.0.1:{server.port}", lookup_timeout_s=10.0)
            try:
                return (await TracedIndex(client).reserve(Reservation("m", "w1", "ra", "r1", 10, 1, None))).reserved
            finally:
                await client.close()

        assert asyncio.run(reserve())
    finally:
        server.stop(0.5)
    (router,), (kv,) = spans_named(spans, "router.reserve"), spans_named(spans, "kv.reserve")
    assert kv.parent is not None and kv.parent.span_id == router.context.span_id
    assert kv.context.trace_id == router.context.trace_id


def test_a_refused_request_has_its_trace_and_the_spans_follow_the_conventions(traced):
    """Issue 50 across the processes: refusals (an unknown model over gRPC and HTTP) are traces with an ERROR
    ``router.request``; an answered request's spans have their kinds, the RPC attributes and status codes, and
    the client's ``tracestate`` reaches the worker's span."""
    import json
    import urllib.error
    import urllib.request

    import grpc

    receiver, stack = traced
    stub = router_pb2_grpc.RouterStub(dial(stack.endpoints["router"]))
    refused_grpc, refused_http, answered = "e1" * 16, "e2" * 16, "e3" * 16
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(router_pb2.GenerateRequest(model="nope", text="hi"),
                           metadata=(("traceparent", f"00-{refused_grpc}-{'01' * 8}-01"),), timeout=60))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    req = urllib.request.Request(f"{stack.endpoints['openai']}/completions",
                                 data=json.dumps({"model": "nope", "prompt": "hi"}).encode(),
                                 headers={"content-type": "application/json",
                                          "traceparent": f"00-{refused_http}-{'02' * 8}-01"})
    with pytest.raises(urllib.error.HTTPError) as http_info:
        urllib.request.urlopen(req, timeout=60)
    assert http_info.value.code == 404
    ids = [(5 * k) % 200 + 3 for k in range(48)]
    out = list(stub.Generate(router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=ids),
                                                        sampling=common_pb2.SamplingParams(max_tokens=4)),
                             metadata=(("traceparent", f"00-{answered}-{'03' * 8}-01"),
                                       ("tracestate", "vendor=x,other=y")), timeout=60))
    assert out[-1].finish_reason

    traces = complete(receiver, [answered])
    deadline = time.monotonic() + 20
    while not all(any(s.name == "router.request" for s in receiver.traces().get(t, []))
                  for t in (refused_grpc, refused_http)) and time.monotonic() < deadline:
        time.sleep(0.1)
    all_traces = receiver.traces()
    (grpc_root,) = [s for s in all_traces[refused_grpc] if s.name == "router.request"]
    assert (grpc_root.status, grpc_root.kind, grpc_root.attributes["rpc.grpc.status_code"]) == ("error", "server", 5)
    assert grpc_root.attributes["error.type"] == "NotFound" and "nope" in grpc_root.status_message
    (http_root,) = [s for s in all_traces[refused_http] if s.name == "router.request"]
    assert (http_root.status, http_root.attributes["http.response.status_code"]) == ("error", 404)

    by_name = {s.name: s for s in traces[answered]}
    root = by_name["router.request"]
    assert root.status == "ok" and root.attributes["rpc.service"] == "kvmesh.v1.Router"
    expect = {"router.request": ("server", "kvmesh.v1.Router"), "router.lookup": ("client", "kvmesh.v1.KVService"),
              "kv.lookup": ("server", "kvmesh.v1.KVService"), "router.forward": ("client", "kvmesh.v1.Worker"),
              "worker.generate": ("server", "kvmesh.v1.Worker")}
    for name, (kind, service) in expect.items():
        s = by_name[name]
        assert (s.kind, s.attributes["rpc.system"], s.attributes["rpc.service"], s.attributes["rpc.grpc.status_code"]) \
            == (kind, "grpc", service, 0), name
    assert by_name["router.forward"].attributes["server.port"] == int(stack.endpoints["worker-0"].rsplit(":", 1)[1])
    assert by_name["router.lookup"].attributes["server.port"] == int(stack.endpoints["kv_service"].rsplit(":", 1)[1])
    assert all(s.kind == "internal" for s in traces[answered] if s.name in ("router.tokenize", "router.hash",
                                                                           "router.pick", "worker.prefill"))
    assert by_name["worker.generate"].trace_state == "vendor=x,other=y"  # with the traceparent, to the worker


def test_event_batches_are_no_traces_of_their_own(traced):
    """A worker's event batches (PublishEvents) are windows of one span per stream with an event per batch,
    not a root trace per batch (issue 50): every root the kv_service exports is such a window."""
    receiver, _ = traced
    deadline = time.monotonic() + 30  # a window ends after 10 s of publishing (or 128 batches)
    while not any(s.name == "kv.publish_events" for s in receiver.spans) and time.monotonic() < deadline:
        time.sleep(0.2)
    kv_roots = [s for s in receiver.spans if s.service == "kvmesh-kv-service" and not s.parent_id]
    assert kv_roots and {s.name for s in kv_roots} == {"kv.publish_events"}
    batches = [e for s in kv_roots for e in s.events if e[0] == "kv.batch"]
    assert len(batches) >= len(kv_roots) and all(s.kind == "server" for s in kv_roots)
