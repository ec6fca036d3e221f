"""kvmesh/transport/'s AioServer on loopback: graceful drain and the in-flight count."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.transport.channels import dial
from kvmesh.transport.loop import LoopThread
from kvmesh.transport.server import AioServer
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.support import wait_until


class Ticker(worker_pb2_grpc.WorkerServicer):
    """Generate: one token every 20 ms, max_tokens of them; with cache_salt "flood" as fast as
    gRPC takes them (the generator then waits in its yield, not in a sleep of its own)."""

    async def Generate(self, request, context):
        flood = request.cache_salt == "flood"
        for t in range(request.sampling.max_tokens):
            if not flood:
                await asyncio.sleep(0.02)
            yield worker_pb2.WorkerGenerateResponse(token_ids=[t] * (1000 if flood else 1))
        yield worker_pb2.WorkerGenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH)


@pytest.fixture
def ticker():
    loop = LoopThread("ticker")

    async def build() -> AioServer:
        server = AioServer("127.0.0.1", 0)
        worker_pb2_grpc.add_WorkerServicer_to_server(Ticker(), server.server)
        server.add_service("kvmesh.v1.Worker")
        await server.start()
        await server.set_serving(True)
        return server

    server = loop.run(build())
    yield loop, server
    if loop.running:
        loop.run(server.stop(0))
        loop.stop()


def stream(address: str, n: int, salt: str = ""):
    return worker_pb2_grpc.WorkerStub(dial(address)).Generate(
        worker_pb2.WorkerGenerateRequest(prompt_token_ids=[1], sampling=common_pb2.SamplingParams(max_tokens=n),
                                         cache_salt=salt), timeout=30)


def test_streams_the_client_leaves_are_no_longer_in_flight(ticker):
    loop, server = ticker
    address = f"127.0.0.1:{server.port}"
    # Half of them wait in their own sleep when the client leaves, half in their yield.
    calls = [stream(address, 100_000, "flood" if i % 2 else "") for i in range(6)]
    for c in calls:
        next(c)
    assert len(server.gate._tasks) == 6
    for c in calls:
        c.cancel()
    wait_until(lambda: not server.gate._tasks, 5, "cancelled streams to leave the drain gate")
    assert [m.finish_reason for m in stream(address, 2)][-1] == common_pb2.FINISH_REASON_LENGTH
    assert not server.gate._tasks


def test_drain_refuses_new_calls_lets_short_ones_finish_and_cuts_long_ones(ticker):
    loop, server = ticker
    address = f"127.0.0.1:{server.port}"
    short, long = stream(address, 10), stream(address, 1000)
    next(short), next(long)
    stopping = threading.Thread(target=loop.run, args=(server.stop(0.6),))
    stopping.start()
    wait_until(lambda: server.gate.closed, 5, "the drain to start")
    with pytest.raises(grpc.RpcError) as refused:
        next(stream(address, 2))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused.value.details()
    health = health_pb2_grpc.HealthStub(dial(address)).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING  # probes still answered
    assert [m.finish_reason for m in short][-1] == common_pb2.FINISH_REASON_LENGTH  # inside the grace
    with pytest.raises(grpc.RpcError) as cut:
        list(long)
    # UNAVAILABLE (retriable), never CANCELLED; its text is the gate's, or grpc's "Cancelling all
    # calls" when the task was cut inside grpc's own write and the port closed first.
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    stopping.join(10)
    assert not stopping.is_alive()


class Counter(worker_pb2_grpc.WorkerServicer):
    """Generate: one token, counting the calls it served."""

    def __init__(self) -> None:
        self.calls = 0

    async def Generate(self, request, context):
        self.calls += 1
        yield worker_pb2.WorkerGenerateResponse(finish_reason=common_pb2.FINISH_REASON_LENGTH)


@pytest.mark.parametrize("form", ["ipv4:{a},{b}", "{a},{b}"])
def test_a_replica_list_target_spreads_calls_round_robin(form):
    loop = LoopThread("replicas")
    counters = [Counter(), Counter()]

    async def build(c: Counter) -> AioServer:
        server = AioServer("127.0.0.1", 0)
        worker_pb2_grpc.add_WorkerServicer_to_server(c, server.server)
        server.add_service("kvmesh.v1.Worker")
        await server.start()
        await server.set_serving(True)
        return server

    servers = [loop.run(build(c)) for c in counters]
    try:
        a, b = (f"127.0.0.1:{s.port}" for s in servers)
        stub = worker_pb2_grpc.WorkerStub(dial(form.format(a=a, b=b)))
        for _ in range(10):
            list(stub.Generate(worker_pb2.WorkerGenerateRequest(
                prompt_token_ids=[1], sampling=common_pb2.SamplingParams(max_tokens=1)), timeout=10))
        # NOTE: round_robin alternates once both subchannels are READY; the first call may go
        # to whichever connected first.
        assert sorted(c.calls for c in counters) in ([5, 5], [4, 6])
    finally:
        for s in servers:
            loop.run(s.stop(0))
        loop.stop()
