"""The bridge between an engine's outside (tests/support/engine_double.py: vLLM's wire formats on
loopback) and a real kv_service on Redis: what the index holds through attach, gaps, loss, engine
restarts and outages, and bad payloads. tests/vllm/ runs the same against the real vLLM."""

from __future__ import annotations

import pytest

from kvmesh.bridge.bridge import Bridge
from kvmesh.bridge.config import BridgeConfig
from kvmesh.contract.block_hash import BlockHasher
from kvmesh.kv_service.config import ServiceConfig
from kvmesh.kv_service.server import KVServiceServer
from kvmesh.kv_service.store_redis import RedisIndex
from kvmesh.loopback import free_port
from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc
from tests.support import wait_until
from tests.support.engine_double import EngineDouble

HASH = BlockHasher("default", 16)
A = list(range(0, 96))  # 3 engine blocks of 32 = 6 kvmesh blocks
B = list(range(500, 564))


@pytest.fixture
def kv(redis_url, redis_namespace):
    server = KVServiceServer(RedisIndex(redis_url, redis_namespace), "127.0.0.1", free_port(),
                             ServiceConfig(lease_ttl_ms=1500, reap_interval_s=0.2)).start()
    yield server
    server.stop(0.5)


@pytest.fixture
def engine():
    e = EngineDouble()
    yield e
    e.close()


@pytest.fixture
def bridges():
    made: list[Bridge] = []
    yield made
    for b in made:
        b.stop()


def start_bridge(bridges, engine: EngineDouble, kv: KVServiceServer, **kw) -> Bridge:
    cfg = BridgeConfig(**{"url": engine.url, "events": engine.events, "replay": engine.replay,
                          "kv_service": f"127.0.0.1:{kv.port}", "metrics_interval": 0.05, "health_interval": 0.2,
                          "replay_timeout": 1.0, **kw})
    b = Bridge(cfg).start()
    bridges.append(b)
    assert b.wait_registered(10)
    return b


def stub(kv: KVServiceServer) -> pb_grpc.KVServiceStub:
    return pb_grpc.KVServiceStub(dial(f"127.0.0.1:{kv.port}"))


def matched(kv: KVServiceServer, tokens: list[int], salt: str = "") -> dict[str, int]:
    r = stub(kv).Lookup(pb.LookupRequest(model_id="default", block_hashes=HASH.hash_prompt(tokens, salt)))
    return {w.worker_id: w.matched_blocks for w in r.workers}


def worker(kv: KVServiceServer, worker_id: str) -> pb.WorkerInfo | None:
    return next((w for w in stub(kv).ListWorkers(pb.ListWorkersRequest()).workers if w.worker_id == worker_id), None)


def store_chain(engine: EngineDouble, tokens: list[int], first_id: int) -> None:
    for i in range(len(tokens) // 32):
        engine.store([first_id + i], first_id + i - 1 if i else None, tokens[32 * i:32 * (i + 1)])


def test_attach_registers_the_engine_and_recovers_what_it_cached_before(engine, kv, bridges):
    store_chain(engine, A, 1)  # before any bridge: only the replay buffer has it
    b = start_bridge(bridges, engine, kv)
    wid = b.worker_id
    assert wid == f"vllm-127.0.0.1-{engine.http_port}" and b.model_id == "default"
    wait_until(lambda: matched(kv, A).get(wid) == 6, what="the replayed chain in the index")
    info = worker(kv, wid)
    assert (info.address, info.block_size, info.num_blocks) == (engine.url, 16, 512 * 2)
    engine.running, engine.waiting = 3, 2
    wait_until(lambda: (worker(kv, wid).load.num_running, worker(kv, wid).load.num_waiting) == (3, 2),
               what="the engine's load on the event stream")
    # estimated queued prefill: waiting x (1000 prompt - 200 cached) / 4 requests
    assert worker(kv, wid).load.queued_prefill_tokens == 2 * 200
    # live events after attach: a removal of the chain's tail, a new chain
    engine.remove([3])
    store_chain(engine, B, 10)
    wait_until(lambda: matched(kv, B).get(wid) == 4 and matched(kv, A).get(wid) == 4, what="live events")


def test_the_load_report_lists_the_engines_lora_adapters_idle_ones_included(engine, kv, bridges):
    engine.max_lora, engine.adapters = 2, ["sql", "chat", "idle"]
    engine.lora_history = [("chat", ""), ("sql", "chat")]
    b = start_bridge(bridges, engine, kv)

    def adapters() -> list[tuple[str, int, int]]:
        return [(a.name, a.level, a.requests) for a in worker(kv, b.worker_id).load.adapters]

    # sql and chat have requests in flight (slots), idle was never asked for (CPU memory)
    GPU, CPU = common_pb2.ADAPTER_LEVEL_GPU, common_pb2.ADAPTER_LEVEL_CPU
    wait_until(lambda: adapters() == [("chat", GPU, 1), ("idle", CPU, 0), ("sql", GPU, 1)],
               what="the adapters in the engine's load report")
    assert worker(kv, b.worker_id).load.max_loras == 2 and b.adapters.source == "inferred"


def test_lost_batches_come_back_by_replay(engine, kv, bridges):
    b = start_bridge(bridges, engine, kv)
    store_chain(engine, A[:32], 1)
    wait_until(lambda: matched(kv, A).get(b.worker_id) == 2, what="first block")
    engine.drop = 2  # the PUB socket loses the next two batches; the buffer keeps them
    store_chain(engine, A, 1)  # blocks 1 (dup), 2, 3
    wait_until(lambda: matched(kv, A).get(b.worker_id) == 6, what="the replayed blocks")
    assert b.stream.replays >= 1 and b.metrics.lost_batches._value.get() == 0 and not b.mirror.degraded


def test_loss_without_replay_degrades_the_mirror_and_sends_a_snapshot(kv, bridges):
    engine = EngineDouble(replay=False)
    try:
        _degrade(engine, kv, bridges)
    finally:
        engine.close()


def _degrade(engine, kv, bridges):
    b = start_bridge(bridges, engine, kv)
    store_chain(engine, A[:64], 1)
    wait_until(lambda: matched(kv, A).get(b.worker_id) == 4, what="two blocks")
    engine.drop = 1
    engine.store([9], None, B[:32])  # lost
    engine.store([3], 2, A[64:96])
    wait_until(lambda: b.mirror.degraded and matched(kv, A).get(b.worker_id) == 6, what="degraded, the rest applied")
    assert b.metrics.lost_batches._value.get() == 1 and b.metrics.degraded._value.get() == 1
    assert matched(kv, B).get(b.worker_id, 0) == 0


def test_a_restarted_engine_gets_a_new_epoch_and_no_stale_blocks(engine, kv, bridges):
    b = start_bridge(bridges, engine, kv)
    store_chain(engine, A, 1)
    wait_until(lambda: matched(kv, A).get(b.worker_id) == 6, what="chain A")
    epoch = worker(kv, b.worker_id).epoch
    engine.new_process()  # seq back to 0
    store_chain(engine, B, 1)
    wait_until(lambda: matched(kv, B).get(b.worker_id) == 4, what="chain B from the new process")
    assert matched(kv, A).get(b.worker_id, 0) == 0 and worker(kv, b.worker_id).epoch > epoch and b.epochs == 2


def test_an_engine_outage_lets_the_lease_lapse_then_rejoins_empty(engine, kv, bridges):
    b = start_bridge(bridges, engine, kv)
    store_chain(engine, A, 1)
    wait_until(lambda: matched(kv, A).get(b.worker_id) == 6, what="chain A")
    engine.healthy = False
    wait_until(lambda: worker(kv, b.worker_id) is None, timeout=10, what="the lease to lapse")
    engine.new_process()
    engine.healthy = True
    wait_until(lambda: worker(kv, b.worker_id) is not None, timeout=10, what="a new registration")
    assert matched(kv, A).get(b.worker_id, 0) == 0 and b.metrics.engine_up._value.get() == 1


def test_bad_payloads_are_counted_and_dropped_and_the_bridge_goes_on(engine, kv, bridges):
    b = start_bridge(bridges, engine, kv)
    for raw in (b"", b"\xc1\xc1", b"\x91" * 50_000):
        engine.publish_raw(raw)
    engine.publish([{"type": "BlockPinned", "block_hashes": [1]}])
    engine.publish([{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                     "token_ids": [1] * 10_000, "block_size": 32}])
    store_chain(engine, A, 1)
    wait_until(lambda: matched(kv, A).get(b.worker_id) == 6, what="good batches after bad ones")
    bad = {s.labels["reason"]: s.value for s in b.metrics.bad_payloads.collect()[0].samples
           if s.name.endswith("_total")}
    assert bad == {"not_msgpack": 3, "bad_event": 1} and b._threads[0].is_alive()
    assert b.metrics.events.labels("unknown")._value.get() == 1


def test_an_engine_block_size_kvmesh_cannot_chunk_is_refused_at_start(kv, bridges):
    e = EngineDouble(block_size=24)
    try:
        with pytest.raises(ValueError, match="do not divide each other"):
            Bridge(BridgeConfig(url=e.url, events=e.events, kv_service=f"127.0.0.1:{kv.port}")).start()
    finally:
        e.close()
