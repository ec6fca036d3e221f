"""The worker gRPC server with a real engine, publishing to a real kv_service on Redis."""

from __future__ import annotations

import itertools

import grpc
import pytest

from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.engine.llm import LLM
from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2
from kvmesh.v1 import kv_service_pb2 as kpb
from kvmesh.v1 import kv_service_pb2_grpc as kpb_grpc
from kvmesh.v1 import worker_pb2 as pb
from kvmesh.v1 import worker_pb2_grpc as pb_grpc
from tests.support import wait_until

PROMPTS = [[(7 * i + 3) % 200 + 5 for i in range(n)] for n in (40, 70, 23)]


def generate(stub, ids, request_id="", **sampling):
    sampling.setdefault("max_tokens", 12)
    msgs = list(stub.Generate(pb.WorkerGenerateRequest(request_id=request_id, prompt_token_ids=ids,
                                                       sampling=common_pb2.SamplingParams(**sampling)), timeout=60))
    return msgs


def index_hashes(kv_stub, worker_id: str, candidates: set[bytes], host: bool = False) -> set[bytes]:
    """Of ``candidates``, the hashes the index says the worker holds on its device (or in its host tier)."""
    out = set()
    for h in candidates:
        r = kv_stub.GetBlock(kpb.GetBlockRequest(block_hash=h), timeout=5)
        if worker_id in (r.host_holders if host else r.holders):
            out.add(h)
    return out


def test_stream_matches_offline_engine_and_index_matches_cache(kv_server, start_worker, model_dir):
    kv_addr = f"127.0.0.1:{kv_server.port}"
    worker = start_worker("w1", kv_addr)
    stub = pb_grpc.WorkerStub(dial(worker.address))
    offline = LLM(str(model_dir), num_blocks=128, max_num_batched_tokens=256, max_model_len=512)
    expected = offline.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    for ids, exp in zip(PROMPTS, expected, strict=True):
        msgs = generate(stub, ids, ignore_eos=True)
        # Token messages (a slow reader may get several tokens in one), then the final one with
        # reason and usage.
        assert all(m.token_ids for m in msgs[:-1]) and msgs[-1].token_ids == []
        assert [t for m in msgs[:-1] for t in m.token_ids] == exp.token_ids
        last = msgs[-1]
        assert (last.finish_reason, last.usage.prompt_tokens, last.usage.completion_tokens, last.worker_id) == (
            common_pb2.FINISH_REASON_LENGTH, len(ids), 12, "w1")
    # The same prompt again hits the prefix cache.
    again = generate(stub, PROMPTS[1], ignore_eos=True)[-1]
    assert again.usage.cached_tokens == (len(PROMPTS[1]) - 1) // 16 * 16
    # The index holds exactly the worker's cached blocks.
    kv_stub = kpb_grpc.KVServiceStub(dial(kv_addr))
    cached = worker.engine.cached_block_hashes()
    assert cached
    wait_until(lambda: kv_stub.ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers[0].blocks_indexed == len(cached),
               what="index to catch up")
    assert index_hashes(kv_stub, "w1", cached) == cached
    load = stub.GetLoad(pb.GetLoadRequest(), timeout=5)
    assert (load.worker_id, load.block_size, load.max_model_len, load.load.num_total_blocks) == ("w1", 16, 512, 128)


def test_a_worker_with_a_host_tier_serves_host_hits_and_the_index_keeps_both_its_tiers(kv_server, start_worker,
                                                                                       model_dir):
    """A prompt evicted to the host tier is served from it over gRPC (cached_tokens counts it, the
    tokens equal an engine without the tier); the worker's host moves reach the kv_service as
    host-tier events: the index holds exactly the worker's device blocks and its host tier's, the
    worker registered with its host tier's size, and a Lookup of the prompt answers how far the host
    tier continues the device prefix."""
    kv_addr = f"127.0.0.1:{kv_server.port}"
    worker = start_worker("w1", kv_addr, num_blocks=12, max_model_len=128, host_kv_blocks=64)
    stub = pb_grpc.WorkerStub(dial(worker.address))
    prompts = [[(11 * i + 5 * k) % 300 + 5 for i in range(90)] for k in range(3)]
    first = generate(stub, prompts[0], ignore_eos=True)
    for p in prompts[1:]:  # two more 90-token prompts push the first out of the 11 device blocks
        generate(stub, p, ignore_eos=True)
    again = generate(stub, prompts[0], ignore_eos=True)
    assert again.pop().usage.cached_tokens == 80 and worker.engine.stats().host_cache_hits == 80
    assert [t for m in again for t in m.token_ids] == [t for m in first[:-1] for t in m.token_ids]
    kv_stub = kpb_grpc.KVServiceStub(dial(kv_addr))
    cached, host = worker.engine.cached_block_hashes(), worker.engine.host_block_hashes()
    assert host - cached  # some blocks are in the host tier only
    # NOTE: equal sets, not equal counts: a batch in flight can remove as many blocks as it stores.
    wait_until(lambda: index_hashes(kv_stub, "w1", cached | host) == cached
               and index_hashes(kv_stub, "w1", cached | host, host=True) == host, what="index to catch up")
    (info,) = kv_stub.ListWorkers(kpb.ListWorkersRequest(), timeout=5).workers
    assert (info.host_blocks, info.blocks_indexed, info.host_blocks_indexed) == (64, len(cached), len(host))
    # the first prompt's blocks: on the device since its load; a third prompt pushes them out again
    chain = worker.engine.block_hasher.hash_prompt(prompts[1])
    (m,) = kv_stub.Lookup(kpb.LookupRequest(model_id=worker.engine.model_id, block_hashes=chain), timeout=5).workers
    assert m.matched_blocks + m.host_blocks == len(chain) and m.host_blocks > 0


def test_client_cancel_frees_blocks(start_worker):
    worker = start_worker("w1", None)
    stub = pb_grpc.WorkerStub(dial(worker.address))
    call = stub.Generate(pb.WorkerGenerateRequest(request_id="long", prompt_token_ids=PROMPTS[1],
                                                  sampling=common_pb2.SamplingParams(max_tokens=400, ignore_eos=True)),
                         timeout=60)
    got = [next(call), next(call)]
    assert all(m.token_ids for m in got)
    assert worker.engine.stats().num_running == 1
    call.cancel()
    kv = worker.engine.kv_cache_manager
    wait_until(lambda: worker.engine.stats().num_running == 0 and kv.num_free_blocks == kv.num_blocks - 1,
               what="blocks freed after cancel")
    assert stub.Abort(pb.AbortRequest(request_id="long"), timeout=5).aborted is False


@pytest.mark.parametrize(("ids", "sampling", "message"), [
    ([1] * 600, {}, "max_model_len is 512"),
    ([5, 99999], {}, "outside the vocabulary"),
    ([], {}, "prompt is empty"),
    ([5, 6], {"temperature": -1.0}, "temperature must be a finite number >= 0"),
    ([5, 6], {"top_p": 1.5}, "top_p must be in (0, 1]"),
    ([5, 6], {"top_k": -2}, "top_k must be an integer in [0, 2**31)"),
])
def test_bad_input_is_invalid_argument_and_worker_keeps_serving(start_worker, ids, sampling, message):
    worker = start_worker("w1", None)
    stub = pb_grpc.WorkerStub(dial(worker.address))
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, ids, **sampling)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in err.value.details()
    assert generate(stub, PROMPTS[2], max_tokens=3)[-1].usage.completion_tokens == 3


def test_streams_past_the_grpc_default_pool_all_reach_the_scheduler(start_worker):
    # More open streams than a default gRPC thread pool: every one must be in the engine
    # (running or waiting), or queued requests would be invisible to the scheduler and the load.
    worker = start_worker("w1", None, max_num_seqs=4)
    stub = pb_grpc.WorkerStub(dial(worker.address))
    calls = [stub.Generate(pb.WorkerGenerateRequest(request_id=f"s{i}", prompt_token_ids=PROMPTS[0],
                                                    sampling=common_pb2.SamplingParams(max_tokens=400, ignore_eos=True)),
                           timeout=60) for i in range(48)]
    try:
        wait_until(lambda: worker.engine.stats().num_running + worker.engine.stats().num_waiting == 48,
                   what="all 48 streams admitted to the engine")
        assert worker.engine.stats().num_running == 4
    finally:
        for c in calls:
            c.cancel()


def test_stream_interval_groups_tokens_after_the_first(start_worker):
    worker = start_worker("w1", None, stream_interval=4)
    stub = pb_grpc.WorkerStub(dial(worker.address))
    msgs = generate(stub, PROMPTS[0], max_tokens=11, ignore_eos=True)
    # The first token at once, then groups of 4; the last group (2 tokens) goes out with the finish.
    # A reader that lags may get neighbouring groups in one message, never a split group.
    ends = list(itertools.accumulate(len(m.token_ids) for m in msgs[:-1]))
    assert set(ends) <= {1, 5, 9, 11} and ends[-1] == 11 and msgs[-1].token_ids == []
    offline = LLM(str(worker.engine.config.model), num_blocks=128, max_num_batched_tokens=256, max_model_len=512)
    (want,) = offline.generate([PROMPTS[0]], SamplingParams(max_tokens=11, ignore_eos=True))
    assert [t for m in msgs[:-1] for t in m.token_ids] == want.token_ids
    assert msgs[-1].usage.completion_tokens == 11


def test_streams_past_max_queued_requests_are_refused_naming_the_flag(start_worker):
    worker = start_worker("w1", None, max_num_seqs=2)
    worker.max_queued_requests = 3  # the WorkerServer's bound (--max-queued-requests)
    stub = pb_grpc.WorkerStub(dial(worker.address))
    calls = [stub.Generate(pb.WorkerGenerateRequest(request_id=f"q{i}", prompt_token_ids=PROMPTS[0],
                                                    sampling=common_pb2.SamplingParams(max_tokens=400, ignore_eos=True)),
                           timeout=60) for i in range(3)]
    try:
        wait_until(lambda: worker.loop.num_streams == 3, what="three streams admitted")
        with pytest.raises(grpc.RpcError) as err:
            generate(stub, PROMPTS[2], max_tokens=2)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "3 requests in flight (--max-queued-requests)" in err.value.details()
    finally:
        for c in calls:
            c.cancel()
    wait_until(lambda: worker.loop.num_streams == 0, what="cancelled streams aborted")
    assert generate(stub, PROMPTS[2], max_tokens=2)[-1].usage.completion_tokens == 2


def test_each_worker_counts_on_its_own_registry(start_worker):
    a, b = start_worker("wa", None), start_worker("wb", None)
    generate(pb_grpc.WorkerStub(dial(a.address)), PROMPTS[2], max_tokens=3, ignore_eos=True)
    model = a.engine.model_id
    assert a.metrics.generation_tokens.labels(model)._value.get() == 3
    assert b.metrics.generation_tokens.labels(model)._value.get() == 0
