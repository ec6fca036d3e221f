"""The running bridge: an engine server (vLLM, SGLang) kept true in kvmesh's index.

Three threads:

- ``bridge-events`` owns the ZMQ sockets and the mirror: it applies the engine's batches in order
  (bridge/event_stream.py replays gaps), turns them into kvmesh block events (bridge/mirror.py) and
  hands them to the publisher (kvmesh/kv_client/publisher.py, the same one kvmesh's workers use:
  registration, lease, batching, RESYNC and snapshots);
- ``bridge-status`` reads the engine's /metrics every ``metrics_interval`` (the load every event
  message carries) and its /health every ``health_interval``;
- the publisher's own two.

The worker's epoch is the engine process's: when the engine's seq goes backwards, or its health
check fails twice and it comes back, the bridge clears the mirror and registers a new epoch, so the
index never keeps a block of the old process. A bridge that restarts (``kill -9``) recovers the
engine's cache by replaying its event buffer from seq 0.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import PurePosixPath

from kvmesh.bridge.adapters import NAMES as ADAPTER_SERIES
from kvmesh.bridge.adapters import AdapterTracker, listed_adapters, parse_lora_info
from kvmesh.bridge.config import BridgeConfig
from kvmesh.bridge.engine_events import BadPayload, EngineCleared, EngineRemoved, EngineStored, decode_batch
from kvmesh.bridge.engine_load import EngineStatus, parse_status, wanted_lines
from kvmesh.bridge.event_stream import Batch, EngineEventStream, Lost, Restarted
from kvmesh.bridge.metrics import BridgeMetrics
from kvmesh.bridge.mirror import EngineMirror, check_block_sizes
from kvmesh.contract.block_hash import DEFAULT_BLOCK_SIZE
from kvmesh.contract.types import (
    H100_8B_KV_BLOCKS,
    AdapterResidency,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    Load,
    Tier,
)
from kvmesh.kv_client.publisher import KVPublisher, registration
from kvmesh.transport import tracing

log = logging.getLogger("kvmesh.bridge")

HTTP_TIMEOUT_S = 2.0
DOWN_AFTER_FAILURES = 2


class EngineUnreachable(Exception):
    pass


def http_get(url: str, timeout: float = HTTP_TIMEOUT_S) -> bytes:
    """GET ``url``; raises EngineUnreachable on any failure."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 - the operator's URL
            return r.read()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise EngineUnreachable(f"{url}: {exc}") from None


class Bridge:
    """Args:
    config: the bridge's settings (checked).
    metrics: where its counters go (a fresh registry by default).
    """

    def __init__(self, config: BridgeConfig, metrics: BridgeMetrics | None = None) -> None:
        config.check()
        self.cfg = config
        self.metrics = metrics or BridgeMetrics()
        self.worker_id = config.worker_id or config.default_worker_id()
        self.model_id = config.model_id or ""
        self.engine_block_size = 0
        self.capacity_tokens = 0
        self.publisher: KVPublisher | None = None
        self.mirror: EngineMirror | None = None
        self.stream = EngineEventStream(config.events, config.replay, config.topic, config.replay_timeout,
                                        config.idle_replay_interval)
        self.epochs = 0
        """Epochs registered so far (1 + the engine restarts seen)."""
        self._status: EngineStatus | None = None
        self._load = Load()
        self.adapters = AdapterTracker()
        """The LoRA adapters the engine has loaded, as its load reports say (bridge/adapters.py)."""
        self._listed: list[str] = []
        self._control: queue.Queue[str] = queue.Queue()
        self._stop = threading.Event()
        self._up = False
        self._threads = [threading.Thread(target=self._events_loop, name="bridge-events", daemon=True),
                         threading.Thread(target=self._status_loop, name="bridge-status", daemon=True)]

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> Bridge:
        """Waits for the engine (``startup_timeout``), checks it, attaches, registers, starts.

        Raises:
            ValueError: the engine's block size does not fit kvmesh's, or its model id is unknown.
            TimeoutError: the engine did not answer within ``startup_timeout``.
        """
        self._probe(wait=True)
        self.mirror = EngineMirror(self.model_id, self.cfg.block_size, self.cfg.hash_algorithm,
                                   max_entries=max(1 << 16, 4 * (self.capacity_tokens // max(1, self.engine_block_size))))
        self.stream.connect()
        self._up = True
        self.metrics.engine_up.set(1)
        self._attach()
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._control.put("stop")
        for t in self._threads:
            if t.is_alive():
                t.join(5.0)
        if self.publisher is not None:
            self.publisher.leave()  # NOTE: out of every front's live set at once, not at lease expiry
            self.publisher = None
        self.stream.close()

    def wait_registered(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            p = self.publisher
            if p is not None and p.wait_registered(0.05):
                return True
            time.sleep(0.05)
        return False

    # -- the engine -----------------------------------------------------------------------------
    def _probe(self, wait: bool) -> None:
        """Reads the engine's model and block size; checks them against kvmesh's spec."""
        deadline = time.monotonic() + self.cfg.startup_timeout if self.cfg.startup_timeout else None
        last_log = 0.0
        while True:
            try:
                status = self._scrape()
                if not self.model_id:
                    models = json.loads(http_get(f"{self.cfg.base_url}/v1/models"))
                    served = models["data"][0]["id"]
                    # NOTE: kvmesh names a model by its directory (kvmesh/contract/modelinfo.py).
                    self.model_id = PurePosixPath(served).name or served
                break
            except (EngineUnreachable, KeyError, IndexError, ValueError) as exc:
                if not wait or (deadline is not None and time.monotonic() > deadline):
                    raise TimeoutError(f"the engine at {self.cfg.base_url} does not answer: {exc}") from None
                if time.monotonic() - last_log > 10:
                    log.info("waiting for the engine at %s: %s", self.cfg.base_url, exc)
                    last_log = time.monotonic()
                self._stop.wait(0.5)
                if self._stop.is_set():
                    raise TimeoutError("stopped while waiting for the engine") from None
        if status.block_size:
            check_block_sizes(status.block_size, self.cfg.block_size)
        self.engine_block_size = status.block_size or self.cfg.block_size
        self.capacity_tokens = status.capacity_tokens
        if not self.capacity_tokens:
            # NOTE: the index caps a worker's blocks at its registered count: an unknown capacity
            # must not cap it at nothing. vLLM publishes it unless started with --disable-log-stats.
            self.capacity_tokens = H100_8B_KV_BLOCKS * DEFAULT_BLOCK_SIZE
            log.warning("the engine's /metrics do not say its KV capacity (vLLM: is --disable-log-stats on?); "
                        "assuming %d tokens", self.capacity_tokens)

    def _scrape(self) -> EngineStatus:
        text = http_get(f"{self.cfg.base_url}/metrics").decode("utf-8", "replace")
        status = parse_status(text, self.cfg.engine, self.cfg.block_size)
        self._status = status
        adapters, slots = self._adapters(text)
        # NOTE: the engine's cached blocks are the ones its events stored: the mirror holds them.
        self._load = replace(status.load, num_cached_blocks=len(self.mirror) if self.mirror is not None else 0,
                             adapters=adapters, max_loras=slots)
        return status

    def _adapters(self, text: str) -> tuple[tuple[AdapterResidency, ...], int]:
        """The LoRA adapters the engine has loaded and its slots (bridge/adapters.py), () without LoRA."""
        if self.cfg.engine != "vllm":
            return (), 0
        info = parse_lora_info(wanted_lines(text, ADAPTER_SERIES))
        if info is not None and info.loaded is None:
            # NOTE: a failed read leaves the last list standing until the next scrape
            with contextlib.suppress(EngineUnreachable, ValueError, AttributeError):
                self._listed = listed_adapters(json.loads(http_get(f"{self.cfg.base_url}/v1/models")))
        source = self.adapters.source
        out = self.adapters.update(info, self._listed)
        if self.adapters.source != source:
            log.info("LoRA adapters' residency: %s (%s)", self.adapters.source,
                     "vLLM's residency gauges" if self.adapters.source == "gauges"
                     else "inferred from vllm:lora_requests_info and /v1/models")
        return out

    def load(self) -> Load:
        """The engine's load as last scraped (read by the publisher's threads)."""
        return self._load

    # -- epochs ---------------------------------------------------------------------------------
    def _new_publisher(self) -> None:
        """Registers a new epoch: the index drops what the last one held."""
        if self.publisher is not None:
            self.publisher.stop()
        num_blocks = max(1, self.capacity_tokens // self.cfg.block_size)
        reg = registration(self.worker_id, self.cfg.route_url, self.model_id, self.cfg.block_size,
                           self.cfg.hash_algorithm, num_blocks, engine=self.cfg.engine, role=self.cfg.role)
        self.publisher = KVPublisher(self.cfg.kv_service, reg, self.load).start()
        self.epochs += 1

    def _attach(self) -> None:
        """(Re)joins the engine's stream from seq 0 and registers a new epoch with what it replayed."""
        assert self.mirror is not None
        self.mirror.clear()
        self.stream.reset()
        self._handle(self.stream.attach(), publish=False)
        self._new_publisher()
        assert self.publisher is not None
        if len(self.mirror):
            # NOTE: blocks cached before the bridge attached: one snapshot after registration.
            self.publisher.request_snapshot()
        self.metrics.degraded.set(1 if self.mirror.degraded else 0)
        log.info("attached to %s engine at %s as worker %s (model %s, epoch %d): %d blocks replayed",
                 self.cfg.engine, self.cfg.base_url, self.worker_id, self.model_id, self.publisher.epoch,
                 len(self.mirror))

    # -- the events thread ----------------------------------------------------------------------
    def _events_loop(self) -> None:
        while not self._stop.is_set():
            try:
                cmd = self._control.get_nowait()
            except queue.Empty:
                cmd = ""
            if cmd == "stop":
                return
            if cmd == "down":
                self._engine_down()
                continue
            if cmd == "up":
                self._engine_up()
                continue
            if not self._up:
                self._stop.wait(0.05)
                continue
            try:
                self._handle(self.stream.poll(0.05), publish=True)
                p, m = self.publisher, self.mirror
                if p is not None and m is not None and p.wants_snapshot():
                    p.publish_snapshot(m.snapshot(), m.snapshot(Tier.HOST))
            except Exception:  # noqa: BLE001 - a bridge defect must not end the bridge
                log.exception("bridge events loop failed; continuing")
                self._stop.wait(0.1)

    def _handle(self, items: list, publish: bool) -> None:
        m = self.mirror
        assert m is not None
        for item in items:
            if isinstance(item, Restarted):
                log.warning("the engine's event seq went back to %d: a new engine process; new epoch", item.seq)
                self.metrics.restarts.inc()
                m.clear()
                if publish:
                    self._new_publisher()
                continue
            if isinstance(item, Lost):
                n = "?" if item.end is None else str(item.end - item.first)
                log.warning("lost %s engine batches from seq %d (%s): the mirror is degraded", n, item.first,
                            item.reason)
                self.metrics.lost_batches.inc(0 if item.end is None else item.end - item.first)
                m.degraded = True
                self.metrics.degraded.set(1)
                if publish and self.publisher is not None:
                    self.publisher.request_snapshot()
                continue
            assert isinstance(item, Batch)
            self.metrics.batches.labels("replayed" if item.replayed else "live").inc()
            if tracing.ON:
                with tracing.span("bridge.translate", None, {"kvmesh.engine_seq": item.seq}):
                    self._translate(item, publish)
            else:
                self._translate(item, publish)
        for tier in Tier:
            self.metrics.mirror_blocks.labels(tier.name.lower()).set(m.held(tier))

    def _translate(self, item: Batch, publish: bool) -> None:
        """One engine batch: decoded, applied to the mirror, forwarded as kvmesh block events."""
        m = self.mirror
        assert m is not None
        try:
            batch = decode_batch(item.payload)
        except BadPayload as exc:
            self.metrics.bad_payloads.labels(exc.reason).inc()
            log.warning("dropped engine batch %d: %s", item.seq, exc)
            return
        for reason in batch.bad:
            self.metrics.bad_payloads.labels(reason).inc()
        for name in batch.unknown:
            self.metrics.events.labels("unknown").inc()
            log.debug("skipped an unknown engine event type %r", name)
        skipped = dict(m.skipped)
        out: list[KVCacheEvent] = []
        for ev in batch.events:
            self.metrics.events.labels(_TYPE_NAMES[type(ev)]).inc()
            out += m.apply(ev)
        for reason, n in m.skipped.items():
            if n > skipped.get(reason, 0):
                self.metrics.skipped.labels(reason).inc(n - skipped.get(reason, 0))
        if any(isinstance(e, AllBlocksCleared) for e in out):
            self.metrics.degraded.set(0)
        for e in out:
            if isinstance(e, BlockStored):
                self.metrics.forwarded.labels("stored", e.tier.name.lower()).inc(len(e.block_hashes))
            elif isinstance(e, BlockRemoved):
                self.metrics.forwarded.labels("removed", e.tier.name.lower()).inc(len(e.block_hashes))
        if publish and out and self.publisher is not None:
            self.publisher.publish(out)

    def _engine_down(self) -> None:
        if not self._up:
            return
        self._up = False
        self.metrics.engine_up.set(0)
        log.warning("the engine at %s is down: it leaves the live set; waiting for it", self.cfg.base_url)
        if self.publisher is not None:
            self.publisher.leave()
            self.publisher = None
        if self.mirror is not None:
            self.mirror.clear()

    def _engine_up(self) -> None:
        if self._up:
            return
        try:
            self._probe(wait=False)
        except (TimeoutError, ValueError) as exc:
            log.warning("the engine answers again but cannot be bridged yet: %s", exc)
            return
        self._up = True
        self.metrics.engine_up.set(1)
        self.metrics.restarts.inc()
        self._attach()

    # -- the status thread ----------------------------------------------------------------------
    def _status_loop(self) -> None:
        failures = 0
        next_health = 0.0
        while not self._stop.is_set():
            try:
                self._scrape()
            except (EngineUnreachable, ValueError):
                self.metrics.scrape_failures.inc()
            now = time.monotonic()
            if now >= next_health:
                next_health = now + self.cfg.health_interval
                try:
                    http_get(f"{self.cfg.base_url}/health")
                    healthy = True
                except EngineUnreachable:
                    healthy = False
                failures = 0 if healthy else failures + 1
                if failures >= DOWN_AFTER_FAILURES and self._up:
                    self._control.put("down")
                elif healthy and not self._up:
                    self._control.put("up")
            self._stop.wait(self.cfg.metrics_interval)


_TYPE_NAMES = {EngineStored: "BlockStored", EngineRemoved: "BlockRemoved", EngineCleared: "AllBlocksCleared"}
