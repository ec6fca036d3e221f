"""KV blocks between workers over NIXL, the transfer library vLLM, Dynamo and llm-d use.

Each worker that takes part in prefill/decode disaggregation makes one NIXL agent (UCX backend) at
start and registers its whole KV cache with it (host memory on a CPU worker, device memory on a GPU).
A prefill leg's answer carries the agent's metadata and where its held blocks sit
(:meth:`NixlTransport.describe`); the decode worker adds the prefill worker's agent and READs the
blocks straight from its cache into a buffer of its own (:meth:`NixlTransport.read`), then tells it
to release them (``ReleaseKV``). Where NIXL cannot load (no wheel, no UCX, an agent that fails to
start) :func:`load` says why and returns None, and the worker uses the gRPC stream of ``PullKV``;
the path taken is in the worker's log and its ``kvmesh:kv_transfers{transport}`` metric.

No grpc here.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kvmesh.model_worker.execution.kv_blocks import KVBlocks

log = logging.getLogger("kvmesh.worker.nixl")


def _import_api() -> Any:
    """NIXL's Python API: the CUDA 12 wheel's module (``nixl-cu12``, what ``make setup`` installs), or
    the meta package's."""
    try:
        from nixl_cu12 import _api
    except ImportError:
        from nixl import _api  # type: ignore[no-redef]
    return _api


class NixlError(RuntimeError):
    """A NIXL read failed (the peer died, the connection was cut, the time ran out)."""


class NixlTransport:
    """One worker's NIXL agent, its KV cache registered.

    Args:
        name: the agent's name (unique in the mesh: the worker id).
        kv_blocks: the worker's KV cache as blocks (model_worker/execution/kv_blocks.py).
    """

    PROGRESS_S = 0.0002
    """While this worker holds blocks for a decode worker, its agent is progressed this often."""

    def __init__(self, name: str, kv_blocks: KVBlocks, serving: Callable[[], bool] = lambda: False) -> None:
        api = _import_api()
        self.name = name
        self.kv_blocks = kv_blocks
        # NOTE: no progress thread of NIXL's own: on a CPU (UCX over TCP / shared memory) it spins, ~0.45 of a
        # core per idle worker (measured). A reader polls its own transfers; the side being read must progress
        # too, so a thread of ours does, only while ``serving()`` (a hold exists), and sleeps otherwise.
        self.agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self._serving = serving
        self._stop = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, name="nixl-progress", daemon=True)
        self._progress.start()
        self._mem = "VRAM" if kv_blocks.device.type == "cuda" else "DRAM"
        self._registered = [self.agent.register_memory(t) for pair in kv_blocks.caches for t in pair]
        self._remotes: set[str] = set()
        self._lock = threading.Lock()
        self._metadata = base64.b64encode(self.agent.get_agent_metadata()).decode()

    def _progress_loop(self) -> None:
        while not self._stop.is_set():
            if self._serving():
                try:
                    self.agent.get_new_notifs()  # NOTE: progresses the backend: the peers' reads complete
                except Exception:  # noqa: BLE001 - keep progressing; a failed peer shows on its side
                    log.debug("NIXL progress failed", exc_info=True)
                time.sleep(self.PROGRESS_S)
            else:
                self._stop.wait(0.005)

    def close(self) -> None:
        self._stop.set()
        self._progress.join(1.0)

    def describe(self, block_ids: tuple[int, ...]) -> bytes:
        """What a decode worker needs to READ these blocks of this worker's cache (KVSource.nixl_metadata)."""
        bases = [[k.data_ptr(), v.data_ptr()] for k, v in self.kv_blocks.caches]
        dev = self.kv_blocks.device.index or 0
        return json.dumps({"agent": self.name, "md": self._metadata, "bases": bases, "dev": dev,
                           "size": self.kv_blocks.layer_block_bytes, "mem": self._mem,
                           "blocks": list(block_ids)}).encode()

    def read(self, description: bytes, start: int, n: int, timeout_s: float) -> torch.Tensor:
        """Blocks ``start .. start + n`` of the held run ``description`` names, read from the peer's cache
        into a new host buffer in wire layout. Raises NixlError (never hangs past ``timeout_s``)."""
        try:
            d = json.loads(description)
            peer, size, bases, ids = d["agent"], int(d["size"]), d["bases"], d["blocks"][start:start + n]
        except (ValueError, KeyError, TypeError) as exc:
            raise NixlError(f"unreadable NIXL description: {exc}") from None
        if size != self.kv_blocks.layer_block_bytes or len(bases) != len(self.kv_blocks.caches) or len(ids) != n:
            raise NixlError("the peer's NIXL description does not match this worker's KV layout")
        agent = self.agent
        with self._lock:
            if peer not in self._remotes:
                agent.add_remote_agent(base64.b64decode(d["md"]))
                self._remotes.add(peer)
        dst = self.kv_blocks.empty(n)
        reg = agent.register_memory(dst)
        handle = None
        try:
            base = dst.data_ptr()
            local = [(base + i * size, size, 0) for i in range(n * len(bases) * 2)]
            remote = [(bases[layer][kv] + b * size, size, int(d.get("dev", 0)))
                      for b in ids for layer in range(len(bases)) for kv in (0, 1)]
            local_descs = agent.get_xfer_descs(local, "DRAM")
            remote_descs = agent.get_xfer_descs(remote, d.get("mem", "DRAM"))
            handle = agent.initialize_xfer("READ", local_descs, remote_descs, peer, b"")
            state = agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state != "DONE":
                if state == "ERR":
                    raise NixlError(f"NIXL read from {peer} failed")
                if time.monotonic() > deadline:
                    raise NixlError(f"NIXL read from {peer} took over {timeout_s:g}s")
                time.sleep(0.0002)
                state = agent.check_xfer_state(handle)
            return dst
        except NixlError:
            raise
        except Exception as exc:  # noqa: BLE001 - NIXL raises its own types (nixlBackendError, ...)
            raise NixlError(f"NIXL read from {peer}: {type(exc).__name__}: {exc}") from None
        finally:
            if handle is not None:
                try:
                    agent.release_xfer_handle(handle)
                except Exception:  # noqa: BLE001 - a handle of a failed transfer may refuse release
                    log.debug("NIXL handle release failed", exc_info=True)
            agent.deregister_memory(reg)

    def forget(self, peer: str) -> None:
        """Drops a peer's agent (it restarted or left): the next read adds it anew."""
        with self._lock:
            if peer in self._remotes:
                self._remotes.discard(peer)
                try:
                    self.agent.remove_remote_agent(peer)
                except Exception:  # noqa: BLE001
                    log.debug("NIXL remove_remote_agent failed", exc_info=True)


def load(name: str, kv_blocks: KVBlocks | None,
         serving: Callable[[], bool] = lambda: False) -> tuple[NixlTransport | None, str]:
    """The worker's NIXL transport, or None and why not (the worker then streams blocks over gRPC).
    ``serving``: whether the worker holds blocks for a decode worker now (its agent is progressed then)."""
    if kv_blocks is None:
        return None, "the runner has no KV cache (simulated worker)"
    try:
        return NixlTransport(name, kv_blocks, serving), ""
    except ImportError as exc:
        return None, f"NIXL is not installed ({exc}); install the nixl-cu12 wheel (make setup does)"
    except Exception as exc:  # noqa: BLE001 - a missing UCX, a backend that fails to start, ...
        return None, f"NIXL failed to start: {type(exc).__name__}: {exc}"
