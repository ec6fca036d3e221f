"""The whole stack on loopback: real Redis, kv_service, tiny-model workers and the router."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from tokenizers import Tokenizer

from kvmesh.client import Client
from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import SamplingParams
from kvmesh.loopback import free_port
from kvmesh.model_worker.engine.llm import LLM
from kvmesh.stack import wait_serving
from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from kvmesh.v1 import kv_service_pb2 as kpb
from kvmesh.v1 import kv_service_pb2_grpc as kpb_grpc
from tests.support import wait_until

SHARED = [(11 * i + 7) % 300 + 3 for i in range(80)]  # 5 full blocks of 16
PROMPTS = [SHARED + [9, 8, 7], [4, 5, 6] * 9, SHARED[:40] + [1, 2, 3, 4]]


@pytest.fixture
def stack(kv_server, start_worker, start_router):
    kv_addr = f"127.0.0.1:{kv_server.port}"
    workers = [start_worker("w1", kv_addr), start_worker("w2", kv_addr)]
    router = start_router(kv_addr)
    client = Client(f"127.0.0.1:{router.port}", timeout=60)
    yield kv_addr, workers, router, client
    client.close()


def index_of(kv_addr: str, worker_id: str, candidates: set[bytes]) -> set[bytes]:
    stub = kpb_grpc.KVServiceStub(dial(kv_addr))
    return {h for h in candidates if worker_id in stub.GetBlock(kpb.GetBlockRequest(block_hash=h), timeout=5).holders}


def test_routed_output_equals_offline_engine_and_index_equals_the_workers_caches(stack, model_dir):
    kv_addr, workers, _, client = stack
    offline = LLM(str(model_dir), num_blocks=128, max_num_batched_tokens=256, max_model_len=512)
    expected = offline.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))
    first = client.generate(PROMPTS[0], max_tokens=10, ignore_eos=True)
    assert first.token_ids == expected[0].token_ids and first.usage.cached_tokens == 0
    for ids, exp in zip(PROMPTS[1:], expected[1:], strict=True):
        out = client.generate(ids, max_tokens=10, ignore_eos=True)
        assert out.token_ids == exp.token_ids
    # After the run the index equals the union of the workers' cached blocks.
    for w in workers:
        cached = w.engine.cached_block_hashes()
        wait_until(lambda w=w, cached=cached: index_of(kv_addr, w.worker_id, cached) == cached, what="index sync")
    stub = kpb_grpc.KVServiceStub(dial(kv_addr))
    union = set().union(*(w.engine.cached_block_hashes() for w in workers))
    stats = stub.GetStats(kpb.GetStatsRequest(), timeout=5)
    assert stats.indexed_blocks == len(union)
    assert stats.block_replicas == sum(len(w.engine.cached_block_hashes()) for w in workers)


# Four prefixes of 5 full blocks each, no block in common.
PREFIXES = [[(13 * i + 97 * k + 5) % 300 + 3 for i in range(80)] for k in range(4)]


def test_prefix_follows_its_holder_by_the_index_alone(kv_server, start_worker, start_router):
    """Only the index can explain these routes. Each prefix is served by one worker directly (no
    router ever saw it), the router starts afterwards with its speculative map off, and the four
    workers hold one prefix each: a router blind to the index would have to guess a permutation of
    four (and its cached counts) to pass."""
    kv_addr = f"127.0.0.1:{kv_server.port}"
    workers = [start_worker(f"w{i}", kv_addr) for i in range(len(PREFIXES))]
    for w, prefix in zip(workers, PREFIXES, strict=True):
        stub = worker_pb2_grpc.WorkerStub(dial(w.address))
        list(stub.Generate(worker_pb2.WorkerGenerateRequest(prompt_token_ids=prefix, sampling=common_pb2.SamplingParams(
            max_tokens=2, ignore_eos=True)), timeout=30))
    for w, prefix in zip(workers, PREFIXES, strict=True):
        blocks = set(BlockHasher(w.engine.model_id, 16).hash_prompt(prefix))
        assert len(blocks) == len(prefix) // 16 and blocks <= w.engine.cached_block_hashes()
        wait_until(lambda w=w, blocks=blocks: index_of(kv_addr, w.worker_id, blocks) == blocks,
                   what=f"the index to learn {w.worker_id}'s prefix")
    router = start_router(kv_addr, speculative_ttl_s=0)
    with Client(f"127.0.0.1:{router.port}", timeout=60) as client:
        for w, prefix in zip(workers, PREFIXES, strict=True):
            out = client.generate(prefix + [42, 43], max_tokens=2, ignore_eos=True)
            assert (out.served_by, out.usage.cached_tokens) == (w.worker_id, len(prefix) // 16 * 16)


def test_text_prompt_streams_text_and_usage(stack, model_dir):
    _, _, _, client = stack
    prompt = "Hello there, how are you?"
    pieces = list(client.stream(prompt, max_tokens=6, ignore_eos=True))
    last = pieces[-1]
    assert last.served_by in {"w1", "w2"} and last.usage.completion_tokens == 6
    ids = [t for p in pieces for t in p.token_ids]
    offline = LLM(str(model_dir), num_blocks=128, max_num_batched_tokens=256, max_model_len=512)
    (want,) = offline.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
    assert ids == want.token_ids
    # The deltas, joined, are the decoded completion; they arrive spread over the stream.
    text = "".join(p.text for p in pieces)
    assert text and text == Tokenizer.from_file(str(model_dir / "tokenizer.json")).decode(ids, skip_special_tokens=True)
    assert sum(1 for p in pieces if p.text) >= 2


def test_requests_succeed_with_kv_service_stopped(stack, kv_server):
    _, _, _, client = stack
    assert client.generate(PROMPTS[1], max_tokens=3).usage.completion_tokens == 3
    kv_server.stop(0)
    for ids in PROMPTS:
        out = client.generate(ids, max_tokens=3, ignore_eos=True)
        assert out.usage.completion_tokens == 3 and out.finish_reason == "length"


def test_two_clients_reusing_one_request_id_on_one_worker_both_succeed(kv_server, start_worker, start_router):
    kv_addr = f"127.0.0.1:{kv_server.port}"
    start_worker("w1", kv_addr)
    clients = [Client(f"127.0.0.1:{start_router(kv_addr).port}", timeout=60) for _ in range(2)]
    try:
        # both streams are open on the one worker at once: client ids are only unique per client
        calls = [c.stream(PROMPTS[i], max_tokens=8, ignore_eos=True, request_id="req-1") for i, c in enumerate(clients)]
        firsts = [next(call) for call in calls]
        rests = [list(call) for call in calls]
        assert [sum(len(m.token_ids) for m in [f, *r]) for f, r in zip(firsts, rests, strict=True)] == [8, 8]
    finally:
        for c in clients:
            c.close()


def test_client_cancel_frees_the_workers_blocks(stack):
    _, workers, _, client = stack
    call = client.stream(PROMPTS[0], max_tokens=400, ignore_eos=True)
    next(call)
    next(call)
    call.close()  # the generator's grpc call is cancelled
    for w in workers:
        kv = w.engine.kv_cache_manager
        wait_until(lambda w=w, kv=kv: w.engine.stats().num_running == 0 and kv.num_free_blocks == kv.num_blocks - 1,
                   what=f"{w.worker_id} to free its blocks")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]"),
    ({"top_k": -1}, "top_k must be an integer in [0, 2**31)"),
    ({"prompt": [3] * 600}, "the model's context is 512 tokens"),  # the router refuses it before any worker
    ({"prompt": [3, 10**6]}, "outside the vocabulary"),
])
def test_bad_input_is_invalid_argument_and_stack_keeps_serving(stack, kwargs, message):
    _, _, _, client = stack
    prompt = kwargs.pop("prompt", [5, 6, 7])
    with pytest.raises(grpc.RpcError) as err:
        client.generate(prompt, max_tokens=2, **kwargs)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    assert client.generate([5, 6, 7], max_tokens=2).usage.completion_tokens == 2


def test_killed_worker_leaves_the_index_within_its_lease(kv_server, model_dir):
    kv_addr = f"127.0.0.1:{kv_server.port}"
    port = free_port()
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "kvmesh"), "worker", "--model", str(model_dir), "--host", "127.0.0.1",
         "--port", str(port), "--kv-service", kv_addr, "--worker-id", "doomed", "--num-blocks", "64",
         "--metrics-port", "0", "--torch-threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_serving(f"127.0.0.1:{port}", proc, timeout=60)
        stub = worker_pb2_grpc.WorkerStub(dial(f"127.0.0.1:{port}"))
        list(stub.Generate(worker_pb2.WorkerGenerateRequest(prompt_token_ids=SHARED, sampling=common_pb2.SamplingParams(
            max_tokens=2)), timeout=30))
        kv = kpb_grpc.KVServiceStub(dial(kv_addr))

        def blocks() -> int:
            ws = kv.ListWorkers(kpb.ListWorkersRequest(include_expired=True), timeout=5).workers
            return sum(w.blocks_indexed for w in ws if w.worker_id == "doomed")

        wait_until(lambda: blocks() == len(SHARED) // 16, what="the worker's blocks in the index")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        # Lease 1.5 s: gone from Lookup once it expires, deleted by the reaper soon after.
        wait_until(lambda: not kv.ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers, timeout=5,
                   what="the lease to expire")
        wait_until(lambda: blocks() == 0, timeout=5, what="the reaper to drop its blocks")
        assert kv.GetStats(kpb.GetStatsRequest(), timeout=5).indexed_blocks == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cache_salt_isolates_tenants(stack):
    _, _, _, client = stack
    prompt = SHARED + [77, 78]
    first = client.generate(prompt, max_tokens=2, cache_salt="tenant-a")
    assert first.usage.cached_tokens == 0
    # Tenant B sends the same tokens: never a hit on A's blocks, on any worker.
    other = client.generate(prompt, max_tokens=2, cache_salt="tenant-b")
    assert other.usage.cached_tokens == 0
    again = client.generate(prompt, max_tokens=2, cache_salt="tenant-a")
    assert again.served_by == first.served_by and again.usage.cached_tokens >= len(SHARED) // 16 * 16
