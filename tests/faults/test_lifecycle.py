"""Process lifecycle, black-box: `kvmesh worker` and `kvmesh router` processes on SIGTERM (drain),
and the router's health as its workers come and go (what the Kubernetes probes read).

Every part is its own process started from the CLI and reached over gRPC, so these tests hold
whatever the servers are built on. Workers are `--simulate` with 50 ms per engine step, so a
stream of n tokens takes about n / 20 seconds: long enough to be in flight at SIGTERM.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.client import Client
from kvmesh.contract.block_hash import SHA256_128
from kvmesh.contract.convert import algorithm_to_pb
from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2
from kvmesh.v1 import kv_service_pb2 as kpb
from kvmesh.v1 import worker_pb2 as pb
from kvmesh.v1 import worker_pb2_grpc as pb_grpc
from tests.faults.conftest import Cluster, Proc, kv_stub
from tests.support import wait_until

SLOW = ("--sim-cost-model", "linear", "--sim-step-overhead", "0.05")  # 50 ms per step: 20 tokens a second
SHORT = 10  # tokens of a stream that ends well inside a 3 s grace
PROMPT = [(7 * i + 3) % 300 + 5 for i in range(40)]
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def kv(cluster: Cluster, request) -> Proc:
    """A kv_service of the test's own: no worker of another test (dead, its lease still running)
    is in its index."""
    return cluster.kv_service(f"kv-{request.node.name[:40]}", None, "--store", "memory")


def worker_stream(address: str, max_tokens: int) -> Iterator[pb.WorkerGenerateResponse]:
    stub = pb_grpc.WorkerStub(dial(address))
    return stub.Generate(pb.WorkerGenerateRequest(prompt_token_ids=PROMPT, sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True)), timeout=30)


def refused_while_draining(call) -> grpc.RpcError:
    """Sends new requests until one is refused (the signal is handled asynchronously: one sent
    before the drain starts is served, which is fine); returns the refusal."""
    for _ in range(100):
        try:
            call()
        except grpc.RpcError as err:
            return err
        time.sleep(0.02)
    raise AssertionError("new requests were still accepted 2 s after SIGTERM")


def exit_code(proc: Proc, within: float) -> int:
    assert proc.popen is not None
    try:
        return proc.popen.wait(within)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{proc.name} still running {within:g}s after SIGTERM") from None


def tokens(stream: Iterator) -> tuple[int, object]:
    """Drains a stream: (tokens received, its last message)."""
    n, last = 0, None
    for m in stream:
        n += len(m.token_ids)
        last = m
    return n, last


@pytest.mark.timeout(90)
def test_worker_on_sigterm_finishes_its_streams_refuses_new_ones_and_exits(cluster: Cluster, kv: Proc):
    grace = 3.0
    w = cluster.worker("drain-w", kv.address, None, True, *SLOW, grace=grace)
    short, long = worker_stream(w.address, SHORT), worker_stream(w.address, 1000)
    first = [next(short), next(long)]  # both streams are running at the worker
    assert all(m.token_ids for m in first)
    w.signal(signal.SIGTERM)
    # UNAVAILABLE (clients retry it elsewhere), saying why: the refusal of a server still draining,
    # not a closed port's "connection refused" nor grpc's CANCELLED.
    err = refused_while_draining(lambda: tokens(worker_stream(w.address, 2)))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.details(), err.details()
    # The short stream (about 0.5 s) ends normally inside the grace, every token delivered.
    n, last = tokens(short)
    assert (1 + n, last.finish_reason, last.usage.completion_tokens) == (SHORT, common_pb2.FINISH_REASON_LENGTH, SHORT)
    # The long one (50 s) is cut when the grace runs out, with UNAVAILABLE, not left hanging.
    with pytest.raises(grpc.RpcError) as cut:
        tokens(long)
    assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    assert exit_code(w, grace + 10) == 0


@pytest.mark.timeout(90)
def test_router_on_sigterm_finishes_its_streams_refuses_new_ones_and_exits(cluster: Cluster, kv: Proc):
    grace = 3.0
    # Both start at once (the router is SERVING once it has discovered the worker).
    w = cluster.worker("drain-r-w", kv.address, None, False, *SLOW)
    router = cluster.router(kv.address, 0, name="drain-router", grace=grace)
    assert w.alive()
    with Client(router.address, timeout=30) as client:
        short, long = client.stream(PROMPT, max_tokens=SHORT, ignore_eos=True), client.stream(
            PROMPT, max_tokens=1000, ignore_eos=True)
        assert next(short).token_ids and next(long).token_ids
        router.signal(signal.SIGTERM)
        err = refused_while_draining(lambda: client.generate(PROMPT, max_tokens=2))
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.details(), err.details()
        n, last = tokens(short)
        assert (1 + n, last.finish_reason, last.usage.completion_tokens) == (
            SHORT, common_pb2.FINISH_REASON_LENGTH, SHORT)
        with pytest.raises(grpc.RpcError) as cut:
            tokens(long)
        assert cut.value.code() == grpc.StatusCode.UNAVAILABLE
    assert exit_code(router, grace + 10) == 0


def health(address: str) -> int | None:
    """The overall health status (service ""), or None while the server does not answer."""
    channel = dial(address)
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return None
    finally:
        channel.close()


@pytest.mark.timeout(90)
def test_router_health_is_not_serving_without_a_live_worker(cluster: Cluster):
    """NOT_SERVING while kv_service has no live worker of the model, SERVING once one registers,
    NOT_SERVING again when its lease lapses, SERVING when one registers again. The "workers" are
    registrations made over the kv_service's own API (the one every worker uses), so their leases
    end exactly when the test stops heartbeating."""
    lease_ms = 1000
    kv = cluster.kv_service("kv-health", None, "--store", "memory", lease_ms=lease_ms)
    router = cluster.router(kv.address, 0, name="health-router", wait=False)
    wait_until(lambda: health(router.address) is not None, 60, "the router to answer health checks")
    stub = kv_stub(kv.address)
    assert health(router.address) == NOT_SERVING

    def register(worker_id: str, epoch: int) -> None:
        stub.RegisterWorker(kpb.RegisterWorkerRequest(
            worker_id=worker_id, address="127.0.0.1:1", model_id=cluster.model.name, block_size=16,
            hash_algorithm=algorithm_to_pb(SHA256_128), num_blocks=64, epoch=epoch), timeout=5)

    def live_and_serving(worker_id: str, epoch: int) -> bool:
        # NOTE: the registration is kept alive while we wait: on a loaded host the router's
        # next discovery poll may come later than a 1 s lease.
        stub.Heartbeat(kpb.HeartbeatRequest(worker_id=worker_id, epoch=epoch), timeout=5)
        return health(router.address) == SERVING

    register("h1", 1)
    wait_until(lambda: live_and_serving("h1", 1), 20, "SERVING once a worker registered")
    # h1 heartbeats no more: its lease lapses after 1 s; the router doubts an empty worker list
    # for 5 s (a restarted Redis lists nobody for a moment), then reports NOT_SERVING.
    wait_until(lambda: health(router.address) == NOT_SERVING, lease_ms / 1000 + 20, "NOT_SERVING without workers")
    register("h2", 2)
    wait_until(lambda: live_and_serving("h2", 2), 20, "SERVING again once a worker registered")
