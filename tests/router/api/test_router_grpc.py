"""The router over real gRPC, with a real kv_service on the real Redis fixture and an in-test worker."""

from __future__ import annotations

import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.kv_service.config import ServiceConfig
from kvmesh.kv_service.server import KVServiceServer
from kvmesh.kv_service.store_redis import RedisIndex
from kvmesh.loopback import free_port
from kvmesh.make_model import train_tokenizer
from kvmesh.router.config import RouterConfig, RoutingConfig
from kvmesh.router.core.policies.base import PolicyConfig
from kvmesh.router.server import RouterServer
from kvmesh.transport.channels import dial
from kvmesh.transport.loop import LoopThread
from kvmesh.transport.server import AioServer
from kvmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from kvmesh.v1 import kv_service_pb2 as kv_pb
from kvmesh.v1 import kv_service_pb2_grpc as kv_grpc

BS = 4


class EchoWorker(worker_pb2_grpc.WorkerServicer):
    """Streams back a fixed reply one token per message, as the real worker's Generate does."""

    def __init__(self, worker_id: str, reply: list[int]) -> None:
        self.worker_id, self.reply = worker_id, reply
        self.prompts: list[list[int]] = []

    async def Generate(self, request, context):
        self.prompts.append(list(request.prompt_token_ids))
        for t in self.reply[:-1]:
            yield worker_pb2.WorkerGenerateResponse(token_ids=[t])
        yield worker_pb2.WorkerGenerateResponse(
            token_ids=[self.reply[-1]], finish_reason=common_pb2.FINISH_REASON_LENGTH, worker_id=self.worker_id,
            usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), cached_tokens=0,
                                   completion_tokens=len(self.reply)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("models") / "m"
    d.mkdir()
    train_tokenizer().save(str(d / "tokenizer.json"))
    return d


@pytest.fixture
def stack(redis_url, redis_namespace, model_dir):
    kv = KVServiceServer(RedisIndex(redis_url, redis_namespace), "127.0.0.1", free_port(),
                         ServiceConfig(lease_ttl_ms=60_000, reap_interval_s=1.0)).start()
    kv_channel = dial(f"127.0.0.1:{kv.port}")
    kv_stub = kv_grpc.KVServiceStub(kv_channel)
    started: list = []

    def start_router(**kw) -> router_pb2_grpc.RouterStub:
        cfg = RouterConfig(host="127.0.0.1", port=0, kv_service=f"127.0.0.1:{kv.port}", model_dirs=[str(model_dir)],
                           routing=RoutingConfig(discovery_interval_s=0.1, policy_config=PolicyConfig(seed=0)), **kw)
        r = RouterServer(cfg).start()
        ch = dial(f"127.0.0.1:{r.port}")
        started.append((r, ch))
        return router_pb2_grpc.RouterStub(ch), ch, r

    yield kv, kv_stub, start_router
    for r, ch in started:
        ch.close()
        r.stop(0.5)
    kv_channel.close()
    kv.stop(0.5)


def register(kv_stub, wid: str, address: str, hashes: list[bytes] = ()) -> None:
    kv_stub.RegisterWorker(kv_pb.RegisterWorkerRequest(
        worker_id=wid, address=address, model_id="m", block_size=BS,
        hash_algorithm=kv_pb.HASH_ALGORITHM_SHA256_128, num_blocks=1000, epoch=1), timeout=5)
    if hashes:
        acks = list(kv_stub.PublishEvents(iter([kv_pb.PublishEventsRequest(
            worker_id=wid, epoch=1, seq=1, events=[kv_pb.KVEvent(stored=kv_pb.BlockStored(block_hashes=hashes))])]),
            timeout=5))
        assert acks[0].action == kv_pb.PUBLISH_ACTION_ACK


class EchoServer:
    """The EchoWorker on a grpc.aio server of its own loop, as the real worker serves."""

    def __init__(self, worker: EchoWorker) -> None:
        self._loop = LoopThread("echo-worker")

        async def build() -> AioServer:
            server = AioServer("127.0.0.1", 0)
            worker_pb2_grpc.add_WorkerServicer_to_server(worker, server.server)
            await server.start()
            return server

        self.server = self._loop.run(build())
        self.port = self.server.port

    def stop(self, grace: float) -> None:
        self._loop.run(self.server.stop(grace))
        self._loop.stop()


def start_worker(worker: EchoWorker) -> EchoServer:
    return EchoServer(worker)


def wait_for(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def health(channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service="kvmesh.v1.Router"), timeout=5).status


def generate(stub, **kw) -> list[router_pb2.GenerateResponse]:
    return list(stub.Generate(router_pb2.GenerateRequest(**kw), timeout=10))


def test_no_reachable_worker_is_unavailable_and_router_keeps_serving(stack):
    kv, kv_stub, start_router = stack
    register(kv_stub, "w1", f"127.0.0.1:{free_port()}")  # nothing listens there
    stub, channel, router = start_router()
    wait_for(lambda: health(channel) == health_pb2.HealthCheckResponse.SERVING)
    for _ in range(2):
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, token_ids=router_pb2.TokenIds(ids=list(range(1, 20))))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        details = err.value.details()
        assert details.startswith("no worker could take the request after 1 attempt(s) (unavailable)")
        assert "w1" not in details and "127.0.0.1" not in details  # no internal topology in public messages
    assert health(channel) == health_pb2.HealthCheckResponse.SERVING


def test_bad_input_is_invalid_argument(stack):
    kv, kv_stub, start_router = stack
    register(kv_stub, "w1", f"127.0.0.1:{free_port()}")
    stub, _, _ = start_router()
    cases = [
        (dict(text=""), "text is empty: send a non-empty prompt"),
        (dict(), "the request sets no input: set text, token_ids or chat"),
        (dict(token_ids=router_pb2.TokenIds(ids=[])), "token_ids is empty: send at least one prompt token"),
        (dict(text="hi", sampling=common_pb2.SamplingParams(temperature=-1.0)),
         "temperature must be a finite number >= 0 (0 = greedy) and at most 3.403e+38 (a 32-bit float), got -1.0"),
        (dict(text="hi", sampling=common_pb2.SamplingParams(temperature=float("inf"))),
         "temperature must be a finite number >= 0 (0 = greedy) and at most 3.403e+38 (a 32-bit float), got inf"),
        (dict(text="hi", sampling=common_pb2.SamplingParams(top_p=1.5)),
         "top_p must be in (0, 1] (leave it unset for 1), got 1.5"),
        (dict(text="hi", sampling=common_pb2.SamplingParams(top_p=0.0)),
         "top_p must be in (0, 1] (leave it unset for 1), got 0.0"),
        (dict(text="hi", sampling=common_pb2.SamplingParams(max_tokens=0)),
         "max_tokens must be an integer in [1, 2**32) (leave it unset for the default), got 0"),
    ]
    for kw, message in cases:
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, **kw)
        assert (err.value.code(), err.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, message)


def test_prefix_holder_down_retries_on_live_worker_with_text_and_usage(stack, model_dir):
    kv, kv_stub, start_router = stack
    tok = train_tokenizer()
    prompt = "the quick brown fox jumps over the lazy dog"
    ids = tok.encode(prompt, add_special_tokens=True).ids
    reply = tok.encode("héllo 😀", add_special_tokens=False).ids
    live = EchoWorker("live", reply)
    server = start_worker(live)
    try:
        chain = BlockHasher("m", BS).hash_prompt(ids)
        register(kv_stub, "dead", f"127.0.0.1:{free_port()}", chain)  # holds the whole prefix, is down
        register(kv_stub, "live", f"127.0.0.1:{server.port}")
        stub, _, router = start_router()
        wait_for(lambda: len(router.pool.endpoints()) == 2)
        out = generate(stub, text=prompt)
        assert "".join(m.text for m in out) == "héllo 😀"
        assert [list(m.token_ids) for m in out] == [[t] for t in reply]
        assert not any("\ufffd" in m.text for m in out)
        last = out[-1]
        assert (last.served_by, last.finish_reason, last.usage.prompt_tokens, last.usage.completion_tokens) == (
            "live", common_pb2.FINISH_REASON_LENGTH, len(ids), len(reply))
        assert live.prompts == [ids]
        assert not router.pool.healthy("dead")

        # kv_service goes away: the router keeps its worker set and routes by rendezvous hash.
        kv.stop(0.1)
        out = generate(stub, token_ids=router_pb2.TokenIds(ids=ids))
        assert out[-1].served_by == "live"
    finally:
        server.stop(0.1)


class HangingWorker(worker_pb2_grpc.WorkerServicer):
    """Sends one token, then holds the stream open until released."""

    def __init__(self) -> None:
        self.release = None

    async def Generate(self, request, context):
        import asyncio

        if self.release is None:
            self.release = asyncio.Event()
        yield worker_pb2.WorkerGenerateResponse(token_ids=[5])
        await self.release.wait()
        yield worker_pb2.WorkerGenerateResponse(
            token_ids=[6], finish_reason=common_pb2.FINISH_REASON_LENGTH, worker_id="hang",
            usage=common_pb2.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=2))


def test_streams_past_max_streams_are_refused_naming_the_flag_and_health_stays_answered(stack):
    kv, kv_stub, start_router = stack
    worker = HangingWorker()
    server = start_worker(worker)
    try:
        register(kv_stub, "hang", f"127.0.0.1:{server.port}")
        stub, channel, router = start_router(max_streams=2)
        wait_for(lambda: len(router.pool.endpoints()) == 1)
        req = router_pb2.GenerateRequest(token_ids=router_pb2.TokenIds(ids=list(range(1, 20))))
        open_streams = [stub.Generate(req, timeout=30) for _ in range(2)]
        assert [list(next(s).token_ids) for s in open_streams] == [[5], [5]]
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, token_ids=router_pb2.TokenIds(ids=list(range(1, 20))))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "2 streams open (--max-streams)" in err.value.details()
        assert health(channel) == health_pb2.HealthCheckResponse.SERVING  # never refused
        server._loop.loop.call_soon_threadsafe(worker.release.set)
        assert [list(s)[-1].finish_reason for s in open_streams] == [common_pb2.FINISH_REASON_LENGTH] * 2
        assert router.metrics.refused._value.get() == 1
        assert router.frontend.streams == 0  # the stream count both protocols share
        # A slot is free again: the next stream is served.
        assert generate(stub, token_ids=router_pb2.TokenIds(ids=list(range(1, 20))))[-1].served_by == "hang"
    finally:
        server.stop(0.1)
