"""`kvmesh kv-service` as a real process on a real Redis, driven by `kvmesh admin`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.loopback import free_port
from kvmesh.stack import wait_serving
from kvmesh.transport.channels import dial
from kvmesh.v1 import kv_service_pb2 as pb
from kvmesh.v1 import kv_service_pb2_grpc as pb_grpc

KVMESH = str(Path(sys.executable).parent / "kvmesh")


@pytest.fixture
def kv_process(redis_url, redis_namespace):
    port, metrics_port = free_port(), free_port()
    proc = subprocess.Popen(
        [KVMESH, "kv-service", "--host", "127.0.0.1", "--port", str(port), "--redis-url", redis_url,
         "--namespace", redis_namespace, "--metrics-port", str(metrics_port),
         # NOTE: the workers never heartbeat, and a dozen `kvmesh admin` processes took longer than the default
         # 10 s lease on a loaded 2-core host (the worker left the index mid-test)
         "--lease-ttl-ms", "600000"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, proc, 20)
        yield proc, address, metrics_port
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def admin(address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([KVMESH, "admin", *args, "--kv-service", address], capture_output=True, text=True, timeout=30)


def test_admin_commands_against_a_real_server(kv_process):
    proc, address, metrics_port = kv_process
    stub = pb_grpc.KVServiceStub(dial(address))
    stub.RegisterWorker(pb.RegisterWorkerRequest(
        worker_id="w1", address="10.0.0.1:50061", model_id="tiny", block_size=4,
        hash_algorithm=pb.HASH_ALGORITHM_SHA256_128, num_blocks=64, epoch=3, host_blocks=32), timeout=5)
    chain = BlockHasher("tiny", 4).hash_prompt(list(range(1, 13)))
    host = pb.KV_TIER_HOST
    list(stub.PublishEvents(iter([
        pb.PublishEventsRequest(worker_id="w1", epoch=3, seq=1,
                                events=[pb.KVEvent(stored=pb.BlockStored(block_hashes=chain))]),
        # the last block evicted from the device into the host tier
        pb.PublishEventsRequest(worker_id="w1", epoch=3, seq=2,
                                events=[pb.KVEvent(removed=pb.BlockRemoved(block_hashes=chain[2:])),
                                        pb.KVEvent(stored=pb.BlockStored(block_hashes=chain[2:], tier=host))])]),
        timeout=5))

    stats = json.loads(admin(address, "stats", "--json").stdout)
    assert {k: stats[k] for k in ("store", "live_workers", "indexed_blocks", "block_replicas", "host_indexed_blocks",
                                  "host_block_replicas")} == {
        "store": "redis", "live_workers": 1, "indexed_blocks": 2, "block_replicas": 2, "host_indexed_blocks": 1,
        "host_block_replicas": 1}
    assert stats["models"] == [{"model_id": "tiny", "block_size": 4, "hash_algorithm": "sha256_128", "live_workers": 1}]
    assert ["host_indexed_blocks", "1"] in [row.split() for row in admin(address, "stats").stdout.splitlines()]

    workers = json.loads(admin(address, "workers", "--json").stdout)
    assert [(w["worker_id"], w["address"], w["blocks_indexed"], w["host_blocks_indexed"], w["host_blocks"], w["epoch"],
             w["last_seq"]) for w in workers] == [("w1", "10.0.0.1:50061", 2, 1, 32, 3, 2)]
    table = [row.split() for row in admin(address, "workers").stdout.splitlines()]
    assert dict(zip(table[0], table[1], strict=True)) | {"lease_ms": ""} == {
        "worker": "w1", "engine": "kvmesh", "role": "both", "address": "10.0.0.1:50061", "model": "tiny", "blocks": "2",
        "capacity": "64", "host_blocks": "1", "host_capacity": "32", "running": "0", "waiting": "0", "picked": "0",
        "lease_ms": "", "live": "yes"}

    looked = json.loads(admin(address, "lookup", "--tokens", "1,2,3,4,5,6,7,8,0,0,0,0", "--model-id", "tiny", "--json").stdout)
    assert [(w["worker_id"], w["matched_blocks"], w["matched_tokens"], w["host_blocks"]) for w in looked["workers"]] == [
        ("w1", 2, 8, 0)]
    looked = json.loads(admin(address, "lookup", "--tokens", ",".join(map(str, range(1, 13))), "--json").stdout)
    assert [(w["worker_id"], w["matched_blocks"], w["host_blocks"]) for w in looked["workers"]] == [("w1", 2, 1)]

    # Without --model / --model-id: the only model the kv_service knows.
    looked = json.loads(admin(address, "lookup", "--tokens", "1,2,3,4,5,6,7,8,0,0,0,0", "--json").stdout)
    assert (looked["model_id"], [(w["worker_id"], w["matched_blocks"]) for w in looked["workers"]]) == ("tiny", [("w1", 2)])
    unknown = admin(address, "lookup", "--tokens", "1,2,3,4", "--model-id", "nope")
    assert unknown.returncode == 0 and "no live worker serves model 'nope'" in unknown.stdout

    # admin hash prints the chain the worker announced, so admin block can look one up.
    hashed = json.loads(admin(address, "hash", "--tokens", ",".join(map(str, range(1, 13))), "--json").stdout)
    assert hashed["block_hashes"] == [h.hex() for h in chain]
    assert (hashed["model_id"], hashed["block_size"], hashed["hash_algorithm"]) == ("tiny", 4, "sha256_128")
    offline = json.loads(admin(f"127.0.0.1:{free_port()}", "hash", "--tokens", "1,2,3,4,5", "--model-id", "tiny",
                               "--block-size", "4", "--hash-algorithm", "sha256_128", "--json").stdout)
    assert offline["block_hashes"] == [chain[0].hex()]
    table = admin(address, "block", hashed["block_hashes"][0])
    assert table.returncode == 0 and "w1" in table.stdout and "refcount" in table.stdout
    in_host = json.loads(admin(address, "block", hashed["block_hashes"][2], "--json").stdout)
    assert (in_host["holders"], in_host["refcount"], in_host["host_holders"]) == ([], 0, ["w1"])

    flushed = json.loads(admin(address, "flush", "w1", "--json").stdout)
    assert flushed == {"worker_id": "w1", "blocks_removed": 3}  # 2 device + 1 host
    table = admin(address, "stats").stdout.splitlines()
    assert table[0].split() == ["stat", "value"] and ["indexed_blocks", "0"] in [row.split() for row in table]

    bad = admin(address, "block", "zz")
    assert bad.returncode == 2 and "block hash must be hex" in bad.stderr
    missing = admin(address, "flush", "ghost")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr

    metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
    assert "kvmesh_kv_lookups_total 3.0" in metrics  # the three lookups of model tiny
    assert 'kvmesh_kv_events_applied_total{kind="stored"} 4.0' in metrics  # 3 device + 1 host

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


def test_admin_lookup_finds_the_tokenizer_and_says_0_blocks_for_a_short_prompt(kv_process, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    _, address, _ = kv_process
    pb_grpc.KVServiceStub(dial(address)).RegisterWorker(pb.RegisterWorkerRequest(
        worker_id="w1", address="10.0.0.1:50061", model_id="tiny", block_size=4,
        hash_algorithm=pb.HASH_ALGORITHM_SHA256_128, num_blocks=64, epoch=1), timeout=5)
    # The model kept where `kvmesh up` keeps its demo model: $KVMESH_CACHE_DIR/models/<id>.
    vocab = ["[unk]", "a", "b", "c", "d", "e", "f", "g", "h"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[unk]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    tok.save(str(tmp_path / "models" / "tiny" / "tokenizer.json"))
    env = {**os.environ, "KVMESH_CACHE_DIR": str(tmp_path)}

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([KVMESH, "admin", *args, "--kv-service", address], capture_output=True, text=True,
                              timeout=30, env=env)

    found = run("lookup", "--text", "a b c d e f g h", "--json")  # no --model: the kv_service's one model, by id
    assert found.returncode == 0, found.stderr
    assert (json.loads(found.stdout)["num_tokens"], json.loads(found.stdout)["num_blocks_queried"]) == (8, 2)
    assert run("lookup", "--text", "a b c d", "--model", "tiny").returncode == 0  # --model as the id
    short = run("lookup", "--text", "a b", "--model", "tiny")
    assert short.returncode == 0 and short.stdout.startswith("2 tokens, 0 full blocks of 4"), short
    assert json.loads(run("lookup", "--tokens", "1", "--json").stdout)["workers"] == []
    assert run("hash", "--text", "a b").stdout.startswith("2 tokens, 0 full blocks of 4")
    missing = run("lookup", "--text", "a", "--model", "nope")
    assert missing.returncode == 2 and "no tokenizer for model 'nope'" in missing.stderr and "--model DIR" in missing.stderr


def test_admin_output_into_a_closed_pipe_is_no_traceback(kv_process):
    _, address, _ = kv_process
    proc = subprocess.Popen([KVMESH, "admin", "stats", "--kv-service", address], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before anything is written (`| head -0`)
    assert proc.wait(timeout=30) == 128 + signal.SIGPIPE
    assert proc.stderr.read() == ""


def test_admin_reports_an_unreachable_service():
    out = admin(f"127.0.0.1:{free_port()}", "stats", "--timeout", "0.5")
    assert out.returncode == 1 and ("UNAVAILABLE" in out.stderr or "DEADLINE_EXCEEDED" in out.stderr)


def test_kv_service_refuses_to_start_without_redis():
    out = subprocess.run([KVMESH, "kv-service", "--port", str(free_port()), "--redis-url",
                          f"redis://127.0.0.1:{free_port()}/0", "--metrics-port", "0"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "cannot reach Redis" in out.stderr and "--store memory" in out.stderr


def test_admin_audit_sums_the_routers_reports_over_every_replica(kv_process, redis_url, redis_namespace):
    """Each replica keeps the miss-audit reports that reached it; `admin audit` asks every address of the
    list and adds them up, with each worker's engine from its registration."""
    from kvmesh.kv_service.server import KVServiceServer
    from kvmesh.kv_service.store_redis import RedisIndex

    _, address, _ = kv_process
    other = KVServiceServer(RedisIndex(redis_url, redis_namespace), "127.0.0.1", free_port()).start()
    try:
        stub = pb_grpc.KVServiceStub(dial(address))
        stub.RegisterWorker(pb.RegisterWorkerRequest(
            worker_id="b1", address="http://10.0.0.2:8000", model_id="tiny", block_size=16,
            hash_algorithm=pb.HASH_ALGORITHM_SHA256_128, num_blocks=64, epoch=3, engine="vllm"), timeout=5)
        stub.ReportAudit(pb.ReportAuditRequest(router_id="ra", workers=[
            pb.WorkerAudit(worker_id="b1", requests=10, predicted_blocks=40, cached_blocks=8, predicted_hits=10,
                           cached_hits=2, silent_misses=8)]), timeout=5)
        pb_grpc.KVServiceStub(dial(f"127.0.0.1:{other.port}")).ReportAudit(pb.ReportAuditRequest(
            router_id="rb", workers=[pb.WorkerAudit(worker_id="b1", requests=10, predicted_blocks=40, cached_blocks=40,
                                                    predicted_hits=10, cached_hits=10)]), timeout=5)
        both = f"{address},127.0.0.1:{other.port}"
        [row] = json.loads(admin(both, "audit", "--json").stdout)
        assert row == {"worker_id": "b1", "engine": "vllm", "requests": 20, "predicted_blocks": 80, "cached_blocks": 48,
                       "predicted_hits": 20, "cached_hits": 12, "silent_misses": 8, "unseen_hits": 0,
                       "silent_miss_rate": 0.4, "unseen_hit_rate": 0.0}
        table = admin(both, "audit").stdout.splitlines()
        assert table[0].split()[:6] == ["worker", "engine", "requests", "predicted_hits", "actual_hits",
                                       "silent_miss_rate"]
        assert table[1].split()[:6] == ["b1", "vllm", "20", "20", "12", "0.400"]
        bad = stub.ReportAudit
        with pytest.raises(grpc.RpcError) as err:
            bad(pb.ReportAuditRequest(router_id="ra", workers=[pb.WorkerAudit(worker_id="bad id!")]), timeout=5)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        other.stop(0.5)
