"""The local stack behind `kvmesh up`: Redis, kv_service, N workers and one or more routers as child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.loopback import RedisServer, die_with_parent
from kvmesh.transport.channels import dial


@dataclass(slots=True)
class StackConfig:
    model: str
    """Model directory served by the workers (the router's default model)."""
    workers: int = 2
    """Workers per model."""
    prefill_workers: int = 0
    """Prefill/decode disaggregation: the first N workers of each model run --role prefill and the rest --role
    decode (docs/architecture.md); 0 = every worker serves whole requests (--role both)."""
    extra_models: list[str] = field(default_factory=list)
    """More model directories, each served by ``workers`` workers of its own behind the same router."""
    http_port: int | None = None
    """The router's OpenAI-compatible HTTP port; None = off."""
    host: str = "127.0.0.1"
    router_port: int = 50051
    """First router's port; router i listens on router_port + 2 * i (between them the kv_service's
    default port stays free)."""
    routers: int = 1
    """Routers over the same kv_service, as the deployment's replicas (docs/router.md, "Several
    routers"); clients spread over them with gRPC's round_robin (``endpoints['routers']``)."""
    kv_service_port: int = 50052
    worker_port: int = 50061
    """First worker port; worker i listens on worker_port + i."""
    metrics_port: int = 9100
    """kv_service on this port, router on +1, worker i on +2+i; 0 = no metrics."""
    redis_url: str | None = None
    """Use this Redis instead of starting a private one."""
    store: str = "redis"
    """'memory' runs the kv_service without Redis."""
    worker_args: list[str] = field(default_factory=list)
    """Extra flags for every `kvmesh worker`."""
    kv_service_args: list[str] = field(default_factory=list)
    """Extra flags for `kvmesh kv-service` (e.g. a short --lease-ttl-ms in tests)."""
    router_args: list[str] = field(default_factory=list)
    router_tokenizer: bool = True
    """Give the router --model (text prompts, detokenized deltas); False = token ids only, no
    per-token detokenization (load generators that send token ids)."""
    simulate: bool = False
    """Simulated workers (`kvmesh worker --simulate`): cost-model forward pass, no weights."""
    log_dir: str | None = None
    """Children's logs go here (default: a new temp dir)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for every child (e.g. KVMESH_ADMIN_TOKEN / KVMESH_API_TOKEN)."""
    vllm: list[str] = field(default_factory=list)
    """Running vLLM servers of the first model, each ``URL,EVENTS[,REPLAY]``: a `kvmesh bridge`
    is started for each (docs/vllm.md)."""
    bridge_args: list[str] = field(default_factory=list)
    """Extra flags for every `kvmesh bridge`."""
    worker_start_timeout: float = 900.0
    """Seconds to wait for each worker to report SERVING: loading, compiling and capturing CUDA graphs
    (a worker warms up before it serves)."""
    otlp_endpoint: str | None = None
    """Every part exports OpenTelemetry traces to this OTLP/gRPC collector (docs/tracing.md); None = off."""
    worker_nice: int = 0
    """Start the workers this much nicer (``nice -n``). For simulated stacks on one small host: in
    a real mesh every worker has its own machine, so Redis, kv_service and router should not queue
    behind the workers' threads for a CPU."""


    def router_ports(self) -> list[int]:
        return [self.router_port + 2 * i for i in range(self.routers)]

    def check(self) -> None:
        """Raises ValueError naming the flag to fix."""
        if self.routers < 1:
            raise ValueError("--routers must be >= 1")
        workers = range(self.worker_port, self.worker_port + self.workers * (1 + len(self.extra_models)))
        clash = [p for p in self.router_ports() if p == self.kv_service_port or p in workers]
        if clash:
            raise ValueError(f"router port {clash[0]} is also the kv_service's or a worker's: move --router-port, "
                             f"--kv-service-port or --worker-port")
        if self.workers < 0 or (self.workers == 0 and not self.vllm):
            raise ValueError("--workers must be >= 1, or 0 with --vllm")
        if self.prefill_workers and not 0 < self.prefill_workers < self.workers:
            raise ValueError(f"--prefill-workers must leave at least one decode worker: between 1 and --workers - 1 "
                             f"({self.workers - 1}), got {self.prefill_workers}")
        for spec in self.vllm:
            parts = spec.split(",")
            if not 2 <= len(parts) <= 3 or not parts[0].startswith(("http://", "https://")) or not all(
                    p.startswith("tcp://") for p in parts[1:]):
                raise ValueError(f"--vllm takes URL,EVENTS[,REPLAY] such as "
                                 f"http://127.0.0.1:8001,tcp://127.0.0.1:5557,tcp://127.0.0.1:5558; got {spec!r}")


def kvmesh_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvmesh.cli", *args]


def wait_serving(address: str, proc: subprocess.Popen | None = None, timeout: float = 120.0) -> None:
    """Waits until the server at ``address`` reports SERVING (grpc.health.v1)."""
    channel = dial(address)
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the process for {address} exited with code {proc.returncode}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{address} not SERVING after {timeout:.0f}s")
    finally:
        channel.close()


def _wait_workers(kv_addr: str, bridged: int, failed, timeout: float = 600.0) -> None:
    """Waits until the kv_service lists ``bridged`` live workers registered by bridges."""
    from kvmesh.v1 import kv_service_pb2 as kv_pb
    from kvmesh.v1 import kv_service_pb2_grpc as kv_grpc

    channel = dial(kv_addr)
    stub = kv_grpc.KVServiceStub(channel)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if failed():
                raise RuntimeError(f"{', '.join(failed())} exited")
            workers = stub.ListWorkers(kv_pb.ListWorkersRequest(), timeout=5).workers
            if sum(1 for w in workers if w.live and w.address.startswith(("http://", "https://"))) >= bridged:
                return
            time.sleep(0.2)
        raise TimeoutError(f"the bridges did not register {bridged} vLLM server(s) within {timeout:.0f}s")
    finally:
        channel.close()


class LocalStack:
    """Starts and stops the stack; ``endpoints`` names what runs where."""

    def __init__(self, cfg: StackConfig) -> None:
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir or tempfile.mkdtemp(prefix="kvmesh-up-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.redis: RedisServer | None = None
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.endpoints: dict[str, str] = {}

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115 - owned by the child for its lifetime
        # NOTE: its own session keeps Ctrl-C to the launcher (which stops the children in order);
        # die_with_parent ends the children when the launcher is killed, SIGKILL included.
        proc = subprocess.Popen([*die_with_parent(), *cmd], stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, **self.cfg.env}, start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def _tracing(self) -> list[str]:
        return ["--otlp-endpoint", self.cfg.otlp_endpoint] if self.cfg.otlp_endpoint else []

    def _metrics(self, offset: int) -> list[str]:
        port = self.cfg.metrics_port + offset if self.cfg.metrics_port else 0
        return ["--metrics-port", str(port)]

    def start(self) -> LocalStack:
        c = self.cfg
        try:
            kv_args = ["--store", "memory"]
            if c.store != "memory":
                if c.redis_url is None:
                    self.redis = RedisServer()
                    self.endpoints["redis"] = self.redis.url
                url = c.redis_url or self.redis.url  # type: ignore[union-attr]
                kv_args = ["--redis-url", url]
            kv_addr = f"{c.host}:{c.kv_service_port}"
            kv = self._spawn("kv_service", kvmesh_cmd("kv-service", "--host", c.host, "--port", str(c.kv_service_port),
                                                      *kv_args, *self._metrics(0), *self._tracing(),
                                                      *c.kv_service_args))
            wait_serving(kv_addr, kv, 30)
            self.endpoints["kv_service"] = kv_addr
            models = [c.model, *c.extra_models]
            total = c.workers * len(models)
            threads = str(max(1, (os.cpu_count() or 1) // max(1, total)))
            workers = []
            for i in range(total):
                port = c.worker_port + i
                addr = f"{c.host}:{port}"
                nice = ["nice", "-n", str(c.worker_nice)] if c.worker_nice else []
                role = ["--role", "prefill" if i % c.workers < c.prefill_workers else "decode"] if c.prefill_workers else []
                # NOTE: worker i serves model i // workers: worker-0.. for the first model, then the next.
                proc = self._spawn(f"worker-{i}", nice + kvmesh_cmd(
                    "worker", "--model", models[i // c.workers], "--host", c.host, "--port", str(port),
                    "--kv-service", kv_addr, "--worker-id", f"worker-{i}", "--advertise-address", addr,
                    "--torch-threads", threads, *self._metrics(2 + i), *(["--simulate"] if c.simulate else []), *role,
                    *self._tracing(),
                    *c.worker_args))
                workers.append((addr, proc))
            for i, (addr, proc) in enumerate(workers):
                wait_serving(addr, proc, c.worker_start_timeout)
                self.endpoints[f"worker-{i}"] = addr
            self._start_bridges(kv_addr, models[0])
            addrs = []
            for i, port in enumerate(c.router_ports()):
                name = "router" if i == 0 else f"router-{i}"
                http = ["--http-port", str(c.http_port + i)] if c.http_port is not None else []
                metrics = self._metrics(1) if i == 0 else self._metrics(
                    2 + c.workers * (1 + len(c.extra_models)) + len(c.vllm) + i - 1)
                proc = self._spawn(name, kvmesh_cmd(
                    "router", "--host", c.host, "--port", str(port), "--kv-service", kv_addr,
                    *(["--model", ",".join(models)] if c.router_tokenizer else []),
                    *http, *metrics, *self._tracing(), *c.router_args))
                addrs.append((name, f"{c.host}:{port}", proc))
            for i, (name, addr, proc) in enumerate(addrs):
                wait_serving(addr, proc, 60)
                self.endpoints[name] = addr
                if c.http_port is not None:
                    self.endpoints["openai" if i == 0 else f"openai-{i}"] = f"http://{c.host}:{c.http_port + i}/v1"
            if len(addrs) > 1:
                self.endpoints["routers"] = "ipv4:" + ",".join(a for _, a, _ in addrs)
        except Exception:
            self.stop()
            raise
        return self

    def _start_bridges(self, kv_addr: str, model: str) -> None:
        """One `kvmesh bridge` per --vllm server; waits until each has registered it."""
        from kvmesh.contract.modelinfo import model_id_for

        c = self.cfg
        for i, spec in enumerate(c.vllm):
            url, events, *replay = spec.split(",")
            metrics = ["--metrics-port", str(c.metrics_port + 2 + c.workers * (1 + len(c.extra_models)) + i)
                       if c.metrics_port else "0"]
            self._spawn(f"bridge-{i}", kvmesh_cmd(
                "bridge", "--url", url, "--events", events, *(["--replay", replay[0]] if replay else []),
                "--kv-service", kv_addr, "--model-id", model_id_for(model), *metrics, *self._tracing(),
                *c.bridge_args))
        if c.vllm:
            _wait_workers(kv_addr, len(c.vllm), lambda: self.failed())
            for i, spec in enumerate(c.vllm):
                self.endpoints[f"vllm-{i}"] = spec.split(",")[0]

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM to every child (router first), SIGKILL whatever is left after ``timeout``."""
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for _, proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()
        if self.redis is not None:
            self.redis.stop()
            self.redis = None

    def failed(self) -> list[str]:
        return [name for name, proc in self.procs if proc.poll() is not None]
