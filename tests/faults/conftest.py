"""Fault scenarios on loopback: real redis-server, kv_service, simulated workers and router processes.

`Cluster` starts each part as its own child process so a test can SIGKILL, SIGSTOP or restart any
one of them; `Traffic` keeps requests flowing (bounded in count and time) and counts outcomes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from kvmesh.bench.scrape import samples, scrape
from kvmesh.client import Client
from kvmesh.loopback import RedisServer, die_with_parent, free_port
from kvmesh.make_model import ModelSpec, make_model
from kvmesh.stack import kvmesh_cmd, wait_serving
from kvmesh.transport.channels import dial
from kvmesh.v1 import kv_service_pb2 as kpb
from kvmesh.v1 import kv_service_pb2_grpc as kpb_grpc

TINY = ModelSpec(arch="llama", layers=2, hidden_size=64, heads=4, kv_heads=2, intermediate_size=128,
                 max_position_embeddings=512, seed=11, init_std=0.05)
LEASE_MS = 4000
"""kv_service lease: short, so 'blocks leave within the lease' is a few seconds of test."""


@pytest.fixture(scope="session")
def fault_model(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("faults") / "tiny-llama", TINY)


@dataclass
class Proc:
    name: str
    cmd: list[str]
    address: str
    log: Path
    popen: subprocess.Popen | None = None

    def start(self) -> Proc:
        with open(self.log, "a") as out:
            # NOTE: die_with_parent: a test run that is killed leaves no server behind.
            self.popen = subprocess.Popen([*die_with_parent(), *self.cmd], stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        return self

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def signal(self, sig: int) -> None:
        assert self.popen is not None
        if self.popen.poll() is None:
            os.kill(self.popen.pid, sig)
        if sig == signal.SIGKILL:
            self.popen.wait(10)

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        os.kill(self.popen.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
        self.popen.terminate()
        try:
            self.popen.wait(5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


@dataclass
class Cluster:
    model: Path
    log_dir: Path
    redis: RedisServer | None = None
    procs: list[Proc] = field(default_factory=list)

    def start_redis(self, port: int | None = None) -> RedisServer:
        self.redis = RedisServer(port=port)
        return self.redis

    def _spawn(self, name: str, address: str, cmd: list[str], wait: bool = True) -> Proc:
        proc = Proc(name, cmd, address, self.log_dir / f"{name}.log").start()
        self.procs.append(proc)
        if wait:
            wait_serving(address, proc.popen, 60)
        return proc

    def kv_service(self, name: str, port: int | None = None, *args: str, lease_ms: int = LEASE_MS) -> Proc:
        """A kv_service on this cluster's Redis (or with ``--store memory`` among ``args``)."""
        port = port or free_port()
        store = [] if "--store" in args else ["--redis-url", self.redis.url] if self.redis else ["--store", "memory"]
        return self._spawn(name, f"127.0.0.1:{port}", kvmesh_cmd(
            "kv-service", "--host", "127.0.0.1", "--port", str(port), *store,
            "--lease-ttl-ms", str(lease_ms), "--metrics-port", "0", *args))

    def worker(self, worker_id: str, kv: str, port: int | None = None, wait: bool = True, *args: str,
               grace: float = 0) -> Proc:
        port = port or free_port()
        addr = f"127.0.0.1:{port}"
        return self._spawn(worker_id, addr, kvmesh_cmd(
            "worker", "--simulate", "--model", str(self.model), "--host", "127.0.0.1", "--port", str(port),
            "--kv-service", kv, "--worker-id", worker_id, "--advertise-address", addr, "--metrics-port", "0",
            "--num-blocks", "4096", "--max-model-len", "2048", "--grace", str(grace), *args), wait)

    def router(self, kv: str, metrics_port: int, *args: str, name: str = "router", grace: float = 0,
               wait: bool = True) -> Proc:
        port = free_port()
        return self._spawn(name, f"127.0.0.1:{port}", kvmesh_cmd(
            "router", "--host", "127.0.0.1", "--port", str(port), "--kv-service", kv, "--model", str(self.model),
            "--metrics-port", str(metrics_port), "--grace", str(grace), *args), wait)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        if self.redis is not None:
            self.redis.stop()


def kv_stub(address: str) -> kpb_grpc.KVServiceStub:
    return kpb_grpc.KVServiceStub(dial(address))


def live_workers(kv: kpb_grpc.KVServiceStub) -> dict[str, kpb.WorkerInfo]:
    try:
        return {w.worker_id: w for w in kv.ListWorkers(kpb.ListWorkersRequest(), timeout=2).workers if w.live}
    except grpc.RpcError:
        return {}


def matched(kv: kpb_grpc.KVServiceStub, model_id: str, ids: list[int]) -> dict[str, int]:
    """Per live worker: leading blocks of ``ids`` the index says it holds."""
    resp = kv.LookupTokens(kpb.LookupTokensRequest(model_id=model_id, token_ids=ids), timeout=5)
    return {m.worker_id: m.matched_blocks for m in resp.workers}


def metric(port: int, name: str, **labels: str) -> float:
    """The sample ``name`` with exactly ``labels`` of the /metrics page on 127.0.0.1:``port``
    (0.0 when absent). ``name`` is the sample's: ``..._total``, ``..._count``."""
    family = name.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    for s in samples(scrape(port), family):
        if s.name == name and s.labels == labels:
            return s.value
    return 0.0


def prompt(family: int, n: int, length: int = 100) -> list[int]:
    """A token-id prompt: 64 tokens shared by its family, then tokens unique to ``n``."""
    head = [(37 * family + 11 * i) % 500 + 3 for i in range(64)]
    return head + [(n * 7919 + 13 * i) % 500 + 3 for i in range(length - 64)]


class Traffic:
    """``threads`` clients sending short requests through the router until stopped.

    Bounded: each request has a deadline, each thread stops after ``max_requests`` or ``max_s``.
    """

    def __init__(self, router: str, threads: int = 3, max_tokens: int = 8, max_requests: int = 2000,
                 max_s: float = 60.0) -> None:
        self.router = router
        self.max_tokens = max_tokens
        self.max_requests = max_requests
        self.max_s = max_s
        self.ok = 0
        self.errors: Counter[str] = Counter()
        self.served_by: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> Traffic:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)
        assert not any(t.is_alive() for t in self._threads), "a traffic thread hung past its deadline"

    def wait_for(self, n: int, timeout: float = 30.0) -> None:
        """Waits until ``n`` more requests have finished (ok or not)."""
        target = self.done + n
        deadline = time.monotonic() + timeout
        while self.done < target:
            assert time.monotonic() < deadline, f"traffic stalled: {self.done} of {target} requests done"
            time.sleep(0.05)

    @property
    def done(self) -> int:
        return self.ok + sum(self.errors.values())

    def _run(self, i: int) -> None:
        end = time.monotonic() + self.max_s
        with Client(self.router, timeout=20) as client:
            for n in range(self.max_requests):
                if self._stop.is_set() or time.monotonic() > end:
                    return
                try:
                    out = client.generate(prompt(n % 4, 1000 * i + n), max_tokens=self.max_tokens, ignore_eos=True)
                except grpc.RpcError as err:
                    with self._lock:
                        self.errors[f"{err.code().name}: {err.details()}"[:200]] += 1
                    continue
                with self._lock:
                    self.ok += 1
                    self.served_by[out.served_by] += 1


@pytest.fixture(scope="module")
def cluster(fault_model, tmp_path_factory) -> Iterator[Cluster]:
    c = Cluster(fault_model, tmp_path_factory.mktemp("fault-logs"))
    try:
        yield c
    finally:
        c.stop()
