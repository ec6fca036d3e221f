"""Faults in a prefill/decode transfer (gRPC streaming path): the prefill worker killed mid-transfer, the
connection cut mid-transfer, the decode worker killed after the transfer. The request completes (the
decode worker prefills it itself) or fails cleanly; no block leaks on any live worker; the index agrees
with the pools."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvmesh.client import Client
from kvmesh.model_worker.serving import kv_transfer
from kvmesh.router.core.pd import PDConfig
from kvmesh.transport.channels import dial
from kvmesh.v1 import kv_service_pb2 as kpb
from kvmesh.v1 import kv_service_pb2_grpc as kpb_grpc
from kvmesh.v1 import worker_pb2
from tests.support import wait_until
from tests.support.model_worker import worker_generate

BS = 16


def ids(n: int, k: int = 0) -> list[int]:
    return [(5 * i + 41 * k + 7) % 500 + 2 for i in range(n)]


def idle(w) -> bool:
    kv = w.engine.kv_cache_manager
    return kv.num_free_blocks == kv.num_blocks - 1 and not w.engine.kv_holds.holds and not w.engine.kv_holds.imports


def index_agrees(kv_addr: str, worker) -> bool:
    """Every block the worker's pool holds is indexed for it, and nothing more (of the worker's count)."""
    infos = kpb_grpc.KVServiceStub(dial(kv_addr)).ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers
    info = next((w for w in infos if w.worker_id == worker.worker_id), None)
    return info is not None and info.blocks_indexed == len(worker.engine.cached_block_hashes())


def cut_after_first_chunk(monkeypatch, worker, action):
    """The prefill worker's PullKV sends one block, then ``action`` happens (a kill, a cut)."""
    monkeypatch.setattr(kv_transfer, "CHUNK_BYTES", 1)  # one block per message
    serve = worker.kv.serve_pull

    async def wrapped(request):
        async for chunk in serve(request):
            yield chunk
            await action()

    monkeypatch.setattr(worker.kv, "serve_pull", wrapped)


@pytest.mark.parametrize("fault", ["prefill_killed", "connection_cut"])
def test_a_transfer_broken_midway_leaves_the_request_to_the_decode_worker(kv_server, start_worker, monkeypatch,
                                                                          fault):
    kv = f"127.0.0.1:{kv_server.port}"
    p = start_worker("pre", kv, role="prefill", kv_transport="grpc")
    d = start_worker("dec", kv, role="decode", kv_transport="grpc")
    a = start_worker("agg", None)
    prompt = ids(150)
    ref, _ = worker_generate(a, prompt, 6, "ref")
    _, last = worker_generate(p, prompt, 1, "r1", worker_pb2.KVTransfer(do_remote_decode=True))
    assert len(last.kv_source.block_hashes) == 9

    async def kill():
        threading.Thread(target=p.stop, args=(0,), daemon=True).start()
        await asyncio.sleep(30)

    async def cut():
        raise RuntimeError("connection cut (test)")

    cut_after_first_chunk(monkeypatch, p, kill if fault == "prefill_killed" else cut)
    tokens, end = worker_generate(d, prompt, 6, "r1", worker_pb2.KVTransfer(source=last.kv_source))
    assert tokens == ref
    assert end.kv_transport == "local" and end.kv_blocks_pulled == 0
    assert d.kv.stats.failed == {"grpc": 1}
    wait_until(lambda: idle(d), what="no block leaked on the decode worker")
    wait_until(lambda: index_agrees(kv, d), what="the index agrees with the decode worker's pool")
    if fault == "connection_cut":
        # the decode worker told the prefill worker to release its hold when the pull failed
        wait_until(lambda: idle(p), what="the prefill worker's hold released")
        wait_until(lambda: index_agrees(kv, p), what="the index agrees with the prefill worker's pool")
    else:
        # the killed worker leaves the index with its lease
        stub = kpb_grpc.KVServiceStub(dial(kv))
        wait_until(lambda: "pre" not in {w.worker_id for w in stub.ListWorkers(kpb.ListWorkersRequest(),
                                                                                timeout=5).workers},
                   timeout=10, what="the killed prefill worker gone from the index")


def test_decode_worker_killed_after_the_transfer_is_migrated_and_frees_everything(kv_server, start_worker,
                                                                                   start_router):
    """The decode worker dies (its drain has no grace) after it pulled the prompt's KV and streamed a few
    tokens: the router migrates the stream (docs/router.md, "Request migration") to the worker left, which
    continues it as a whole request; the client's one stream ends whole, and nothing is held or leaked."""
    kv = f"127.0.0.1:{kv_server.port}"
    p = start_worker("pre", kv, role="prefill", kv_transport="grpc")
    d = start_worker("dec", kv, role="decode", kv_transport="grpc")
    router = start_router(kv, pd=PDConfig(pd_mode="always"))
    wait_until(lambda: len(router.router.pool.endpoints()) == 2, what="both workers discovered")
    client = Client(f"127.0.0.1:{router.port}", timeout=60)
    got: list[int] = []
    served_by = ""
    for msg in client.stream(ids(150, 1), max_tokens=300, ignore_eos=True):
        got += list(msg.token_ids)
        served_by = msg.served_by or served_by
        if len(got) >= 3 and d.kv.stats.pulled_blocks and not d.draining:
            threading.Thread(target=d.stop, args=(0,), daemon=True).start()
    assert len(got) == 300 and served_by == "pre"
    assert router.metrics.migrations._value.get() == 1
    # the prefill worker's hold went with the pull; its pool is back to idle and the index says so
    wait_until(lambda: idle(p), what="no block held or leaked on the prefill worker")
    wait_until(lambda: index_agrees(kv, p), what="the index agrees with the prefill worker's pool")
    stub = kpb_grpc.KVServiceStub(dial(kv))
    wait_until(lambda: "dec" not in {w.worker_id for w in stub.ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers},
               timeout=10, what="the killed decode worker gone from the index")
