"""Prefill/decode legs between two real workers over gRPC (and NIXL): the decode leg's greedy tokens
equal the aggregated worker's and transformers', at prompt lengths on and around block edges; only the
blocks the decode worker lacks travel; bad legs are refused before any KV moves; no block leaks."""

from __future__ import annotations

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvmesh.transport.channels import dial
from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from tests.support import wait_until
from tests.support.model_worker import worker_generate

BS = 16


def ids(n: int, k: int = 0) -> list[int]:
    return [(7 * i + 31 * k + 3) % 500 + 2 for i in range(n)]




def disaggregated(p, d, prompt, rid, max_tokens=6, salt=""):
    first, last = worker_generate(p, prompt, 1, rid, worker_pb2.KVTransfer(do_remote_decode=True), salt)
    assert last.HasField("kv_source")
    tokens, end = worker_generate(d, prompt, max_tokens, rid, worker_pb2.KVTransfer(source=last.kv_source), salt)
    return first, last.kv_source, tokens, end


def idle(worker) -> bool:
    kv = worker.engine.kv_cache_manager
    return (kv.num_free_blocks == kv.num_blocks - 1 and not worker.engine.kv_holds.holds
            and not worker.engine.kv_holds.imports)


@pytest.mark.parametrize("transport", ["grpc", "nixl"])
def test_disaggregated_greedy_tokens_equal_aggregated_and_transformers(start_worker, model_dir, transport):
    p = start_worker("p", None, role="prefill", kv_transport=transport)
    d = start_worker("d", None, role="decode", kv_transport=transport)
    a = start_worker("a", None)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for k, n in enumerate([5, 16, 17, 31, 32, 33, 48, 90]):
        prompt = ids(n, k)
        first, source, tokens, end = disaggregated(p, d, prompt, f"r{k}")
        agg, _ = worker_generate(a, prompt)
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, n:].tolist()
        assert tokens == agg == ref, n
        assert first == ref[:1]
        usable = (n - 1) // BS
        assert len(source.block_hashes) == usable
        # every usable block travelled, over the transport asked for, and the decode worker reports them cached
        assert end.kv_blocks_pulled == usable
        assert end.kv_transport == (transport if usable else "local")
        assert end.usage.cached_tokens == usable * BS
        assert end.kv_bytes_pulled == usable * d.engine.kv_blocks.bytes_per_block
    wait_until(lambda: idle(p) and idle(d), what="no block held or leaked on either worker")
    assert p.kv.stats.served_blocks == (0 if transport == "nixl" else sum((n - 1) // BS for n in [5, 16, 17, 31, 32, 33, 48, 90]))


def test_only_the_blocks_the_decode_worker_lacks_travel(start_worker):
    p = start_worker("p", None, role="prefill", kv_transport="grpc")
    d = start_worker("d", None, role="decode", kv_transport="grpc")
    shared = ids(64, 1)
    worker_generate(d, shared + [9, 9, 9], max_tokens=1)  # the decode worker holds the first 4 blocks now
    prompt = shared + ids(40, 2)  # 104 tokens: 6 usable blocks, 4 of them held by d
    _, source, tokens, end = disaggregated(p, d, prompt, "x")
    assert len(source.block_hashes) == 6
    assert end.kv_blocks_pulled == 2 and end.usage.cached_tokens == 6 * BS
    agg, _ = worker_generate(start_worker("a", None), prompt)
    assert tokens == agg


def test_bad_legs_are_refused_before_any_kv_moves(start_worker, model_dir):
    p = start_worker("p", None, role="prefill", kv_transport="grpc")
    d = start_worker("d", None, role="decode", kv_transport="grpc")
    prompt = ids(50)
    _, last = worker_generate(p, prompt, 1, "ok", worker_pb2.KVTransfer(do_remote_decode=True))
    src = last.kv_source

    def refused(worker, code, text, prompt=prompt, rid="new", kv=None, salt="", max_tokens=6):
        with pytest.raises(grpc.RpcError) as e:
            worker_generate(worker, prompt, max_tokens, rid, kv or worker_pb2.KVTransfer(source=src), salt)
        assert e.value.code() == code, e.value.details()
        assert text in e.value.details()

    # a prefill leg of more than one token; a prefill leg at a decode worker; a decode leg at a prefill worker
    refused(p, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be 1", kv=worker_pb2.KVTransfer(do_remote_decode=True))
    refused(d, grpc.StatusCode.FAILED_PRECONDITION, "takes no prefill leg", kv=worker_pb2.KVTransfer(do_remote_decode=True),
            max_tokens=1)
    refused(p, grpc.StatusCode.FAILED_PRECONDITION, "takes no decode leg")
    # blocks of another block size, dtype or model; blocks of another prompt or salt
    for field, value, text in [("block_size", 32, "block_size"), ("dtype", "bfloat16", "dtype"),
                               ("model_id", "other", "model_id"), ("num_layers", 3, "num_layers")]:
        bad = worker_pb2.KVSource()
        bad.CopyFrom(src)
        setattr(bad.layout, field, value)
        refused(d, grpc.StatusCode.FAILED_PRECONDITION, text, kv=worker_pb2.KVTransfer(source=bad))
    refused(d, grpc.StatusCode.FAILED_PRECONDITION, "not this prompt's", prompt=ids(50, 3))
    refused(d, grpc.StatusCode.FAILED_PRECONDITION, "not this prompt's", salt="tenant")
    refused(d, grpc.StatusCode.INVALID_ARGUMENT, "reusable full blocks", prompt=prompt[:20])
    # nothing was pulled by any of them, and the hold is still there for the good leg
    assert d.kv.stats.pulled_blocks == 0 and "ok" in p.engine.kv_holds.holds
    tokens, end = worker_generate(d, prompt, 6, "ok", worker_pb2.KVTransfer(source=src))
    assert end.kv_blocks_pulled == 3
    wait_until(lambda: idle(p) and idle(d), what="no block held or leaked")


def test_a_request_id_in_flight_is_refused(start_worker):
    p = start_worker("p", None, role="prefill", kv_transport="grpc")
    d = start_worker("d", None, role="decode", kv_transport="grpc")
    prompt = ids(50)
    _, last = worker_generate(p, prompt, 1, "dup", worker_pb2.KVTransfer(do_remote_decode=True))
    stub = worker_pb2_grpc.WorkerStub(dial(d.address))
    long_req = worker_pb2.WorkerGenerateRequest(request_id="dup", prompt_token_ids=ids(40, 5),
                                                sampling=common_pb2.SamplingParams(max_tokens=400, ignore_eos=True))
    it = stub.Generate(long_req, timeout=60)
    next(it)  # in flight now
    with pytest.raises(grpc.RpcError) as e:
        worker_generate(d, prompt, 6, "dup", worker_pb2.KVTransfer(source=last.kv_source))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    it.cancel()
    assert d.kv.stats.pulled_blocks == 0


def test_an_unpulled_hold_expires_and_frees_its_blocks(start_worker):
    p = start_worker("p", None, role="prefill", kv_transport="grpc", kv_hold_ttl_s=0.3)
    _, last = worker_generate(p, ids(70), 1, "h", worker_pb2.KVTransfer(do_remote_decode=True))
    assert len(last.kv_source.block_hashes) == 4 and "h" in p.engine.kv_holds.holds
    wait_until(lambda: idle(p), timeout=5, what="the hold released by its ttl")
