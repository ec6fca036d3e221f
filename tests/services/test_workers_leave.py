"""Workers that leave, leave at once (issue 50): a worker draining at SIGTERM, a worker a front cannot
reach and a worker whose event stream is cut leave every front's live set through the kv_service's
push (WatchWorkers), long before their lease would end or a poll would notice. Real Redis, a real
kv_service, real workers and routers on loopback.

Each test runs with a 30 s lease and routers polling every 60 s: a worker gone from a router within
the tests' deadlines was removed by the push, nothing else.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import grpc
import pytest

from kvmesh.client import Client
from kvmesh.contract.convert import registration_to_pb
from kvmesh.contract.index_protocol import Registration
from kvmesh.kv_client.router_client import KVServiceClient
from kvmesh.loopback import free_port
from kvmesh.transport.channels import dial, dial_aio
from kvmesh.transport.loop import LoopThread
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc
from tests.support.model_worker import worker_generate

LONG_LEASE = 30_000
NO_POLL = {"discovery_interval_s": 60.0}
DEADLINE_S = 8.0
"""Far under the lease (30 s) and the poll (60 s); a push lands in well under a second."""


def until(what: Callable[[], bool], why: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, why
        time.sleep(0.02)


def live(kv_port: int) -> set[str]:
    stub = pb_grpc.KVServiceStub(dial(f"127.0.0.1:{kv_port}"))
    return {w.worker_id for w in stub.ListWorkers(pb.ListWorkersRequest(), timeout=5).workers}


def known(router) -> set[str]:
    return {e.worker_id for e in router.pool.endpoints()}


def register(stub, worker_id: str, address: str, epoch: int = 7) -> None:
    reg = Registration(worker_id, address, "tiny-llama", 16, "sha256_128", 64, epoch)
    stub.RegisterWorker(registration_to_pb(reg), timeout=5)


@pytest.mark.parametrize("kv_server", [LONG_LEASE], indirect=True)
def test_a_draining_worker_leaves_every_router_at_once(kv_server, start_worker, start_router):
    """SIGTERM's drain: the worker says it leaves, the kv_service pushes the new set, and both routers
    drop it while it still finishes the stream it has in flight (which then ends whole)."""
    kv = f"127.0.0.1:{kv_server.port}"
    w0, _ = start_worker("w0", kv), start_worker("w1", kv)
    routers = [start_router(kv, **NO_POLL) for _ in range(2)]
    for r in routers:
        until(lambda r=r: known(r) == {"w0", "w1"}, "the routers never saw both workers")
    streamed: list = []
    in_flight = threading.Thread(target=lambda: streamed.append(worker_generate(w0, [5, 6, 7], max_tokens=400)))
    in_flight.start()
    until(lambda: w0.engine.stats().num_running == 1, "the long stream never started")
    stopping = threading.Thread(target=w0.stop, args=(30.0,))
    stopping.start()
    for r in routers:
        until(lambda r=r: known(r) == {"w1"}, "a router still names the draining worker")
    assert stopping.is_alive() and in_flight.is_alive(), "the drain ended before the routers dropped the worker"
    assert live(kv_server.port) == {"w1"}
    assert kv_server.service.metrics.leaves.labels("draining")._value.get() == 1
    assert all(r.discovery.pushes >= 2 for r in routers)
    in_flight.join(30)
    stopping.join(30)
    assert len(streamed[0][0]) == 400, "the stream in flight did not finish whole"


@pytest.mark.parametrize("kv_server", [LONG_LEASE], indirect=True)
def test_a_worker_nobody_can_reach_leaves_after_one_failed_forward(kv_server, start_worker, start_router):
    """A registered worker whose address refuses connections: the router's first forward to it fails,
    the router reports it, and every front drops it; the request itself is served by the live worker."""
    kv = f"127.0.0.1:{kv_server.port}"
    start_worker("w0", kv)
    stub = pb_grpc.KVServiceStub(dial(kv))
    register(stub, "ghost", f"127.0.0.1:{free_port()}")  # nobody listens there
    router, other = start_router(kv, **NO_POLL), start_router(kv, **NO_POLL)
    for r in (router, other):
        until(lambda r=r: known(r) == {"w0", "ghost"}, "the routers never saw both workers")
    client = Client(f"127.0.0.1:{router.port}", timeout=60)
    # NOTE: the seeded policy splits fresh prompts over both workers: a few requests reach the ghost.
    for i in range(8):
        out = client.generate([1, 2, 3, 4 + i], max_tokens=2, ignore_eos=True)
        assert out.usage.completion_tokens == 2
        if "ghost" not in known(other):
            break
    until(lambda: "ghost" not in known(other), "the other router still names the unreachable worker")
    assert "ghost" not in live(kv_server.port)
    # NOTE: the other router can see the push before the leave's answer reaches the reporter
    until(lambda: router.down_reports.sent >= 1, "the router's report was never answered")
    client.close()


@pytest.mark.parametrize("kv_server", [LONG_LEASE], indirect=True)
def test_a_worker_whose_event_stream_ends_with_no_next_one_leaves(kv_server):
    """A worker's process dies (SIGKILL): its event stream, bound to its liveness, ends and no next one
    comes, and the worker leaves the live set; a worker that opens its next stream at once (a restarted
    stream) stays, and so does one whose stream did not say it is bound. The dying one is a real
    process killed with SIGKILL."""
    stub = pb_grpc.KVServiceStub(dial(f"127.0.0.1:{kv_server.port}"))
    register(stub, "restreams", "127.0.0.1:1")
    child = subprocess.Popen([sys.executable, "-c", KILLED_WORKER, str(kv_server.port)], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout is not None
        assert sorted(child.stdout.readline().strip() for _ in range(2)) == ["killed", "unbound"]
        loop = LoopThread("restream")
        try:
            async def publish(seq: int, hold: bool) -> None:
                channel = dial_aio(f"127.0.0.1:{kv_server.port}")
                call = pb_grpc.KVServiceStub(channel).PublishEvents()
                await call.write(pb.PublishEventsRequest(worker_id="restreams", epoch=7, seq=seq, stream_bound=True))
                await call.read()
                if not hold:
                    await call.done_writing()
                    await channel.close()
                    return
                await asyncio.sleep(1.5)  # NOTE: the next stream is open through the check after the first ended
                await call.done_writing()
                await channel.close()

            async def restream() -> None:
                await publish(1, False)
                await publish(2, True)

            assert "killed" in live(kv_server.port)
            child.kill()
            loop.run(restream())
        finally:
            loop.stop()
        until(lambda: "killed" not in live(kv_server.port), "the killed worker is still live")
        assert {"restreams", "unbound"} <= live(kv_server.port)  # NOTE: an unbound stream's worker keeps its lease
    finally:
        child.kill()
        child.wait()


KILLED_WORKER = """
import sys, threading, time
import grpc
from kvmesh.contract.convert import registration_to_pb
from kvmesh.contract.index_protocol import Registration
from kvmesh.v1 import kv_service_pb2 as pb, kv_service_pb2_grpc as g
stub = g.KVServiceStub(grpc.insecure_channel("127.0.0.1:" + sys.argv[1]))
said = threading.Lock()
def stream(wid, bound):
    stub.RegisterWorker(registration_to_pb(Registration(wid, "127.0.0.1:1", "tiny-llama", 16, "sha256_128", 64, 7)))
    def batches():
        yield pb.PublishEventsRequest(worker_id=wid, epoch=7, seq=1, stream_bound=bound)
        time.sleep(600)
    for ack in stub.PublishEvents(batches()):
        with said:
            print(wid, flush=True)
for wid, bound in (("killed", True), ("unbound", False)):
    threading.Thread(target=stream, args=(wid, bound), daemon=True).start()
time.sleep(600)
"""


def test_a_false_report_costs_one_heartbeat(kv_server, start_worker):
    """A worker reported unreachable that is alive after all registers again at its next heartbeat
    (a 1.5 s lease: one every 0.5 s); a report naming an earlier process (its epoch) changes nothing."""
    kv = f"127.0.0.1:{kv_server.port}"
    w0 = start_worker("w0", kv)
    loop = LoopThread("report")
    try:
        client = loop.run(_client(kv))
        assert not loop.run(client.leave_worker("w0", w0.publisher.epoch - 1, "test"))
        assert "w0" in live(kv_server.port)
        assert loop.run(client.leave_worker("w0", w0.publisher.epoch, "test"))
        assert "w0" not in live(kv_server.port)
        until(lambda: "w0" in live(kv_server.port), "the live worker never came back")
        assert not loop.run(client.leave_worker("nobody", 0, "test"))
        loop.run(client.close())
    finally:
        loop.stop()


def test_leave_worker_refuses_bad_input(kv_server):
    stub = pb_grpc.KVServiceStub(dial(f"127.0.0.1:{kv_server.port}"))
    for req, words in [(pb.LeaveWorkerRequest(worker_id="w0"), "reason"),
                       (pb.LeaveWorkerRequest(worker_id="", reason=pb.LEAVE_REASON_DRAINING), "worker_id"),
                       (pb.LeaveWorkerRequest(worker_id="w0", reason=pb.LEAVE_REASON_DRAINING, reporter="x" * 200),
                        "reporter")]:
        with pytest.raises(grpc.RpcError) as err:
            stub.LeaveWorker(req, timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in err.value.details()


async def _client(kv: str) -> KVServiceClient:
    return KVServiceClient(kv)


@pytest.mark.parametrize("kv_server", [LONG_LEASE], indirect=True)
def test_a_worker_whose_server_went_away_between_requests_is_reported(kv_server, start_worker, start_router):
    """The router's channel to a worker it has talked to loses its connection and cannot make another
    (TRANSIENT_FAILURE): the router reports the worker with no request sent to it since. The worker's
    server alone stops here (its heartbeats and event stream go on), so neither a drain, nor the stream
    rule, nor a failed forward can be what reported it."""
    kv = f"127.0.0.1:{kv_server.port}"
    w0 = start_worker("w0", kv)
    router = start_router(kv, **NO_POLL)
    until(lambda: known(router) == {"w0"}, "the router never saw the worker")
    with Client(f"127.0.0.1:{router.port}", timeout=60) as client:
        assert client.generate([1, 2, 3], max_tokens=2, ignore_eos=True).usage.completion_tokens == 2
    w0._aio.run(w0.grpc.stop(0))  # NOTE: its gRPC server only
    until(lambda: router.down_reports.sent >= 1, "the router never reported the worker it cannot reach")
    assert kv_server.service.metrics.leaves.labels("unreachable")._value.get() >= 1
