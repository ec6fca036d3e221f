"""The mesh in virtual time: one process, one event queue, no threads, sockets or sleeps.

What runs is the production code; only the forward pass and the wire are modelled:

- **workers**: each one a real :class:`LLMEngine` (scheduler, block pool, prefix cache, chunked
  prefill, multi-step windows, block events) whose runner is the simulated one
  (model_worker/sim_runner.py) with ``time_scale=0``: a step *returns* its modelled duration
  and the worker is busy that long on the virtual clock. Its kv publisher and heartbeat are
  modelled after model_worker/kv_publisher.py: block events are merged into one message at most
  every ``event_batch_s``, numbered per epoch, delivered ``event_delay_s`` later; a RESYNC answer
  makes the worker send a snapshot of its cached blocks as its next message; every message
  carries the engine's load as it is sent, and a load that changed without events goes out alone
  in the next message slot (``load_on_events``, the live publisher's behaviour); a heartbeat
  every ``heartbeat_s`` carries it too (with ``load_on_events=False`` the only load report: what
  the router sees of load is then that stale).
- **index**: the kv_service core, :class:`KVService` over the in-memory store (its coroutines
  never suspend there, so ``run_now`` drives them without an event loop; the same
  semantics as the Redis store: refcounts, per-worker LRU caps, leases, epochs, Lookup), on the
  virtual clock.
- **routers**: :class:`RoutingCore` (router/core.py) with the registered policy classes: the same
  planning code as the live router (chain, breaker, candidates from one Lookup + speculative map
  + in-flight view, hot-spot guard, fallback, in-flight accounting). Discovery polls the index
  every ``discovery_s``; a Lookup takes ``lookup_latency_s`` and fails past ``lookup_timeout_s``;
  the first token and the end of a stream reach the router ``network_s`` after the worker sends
  them. A worker that is down answers UNAVAILABLE: the router marks it unhealthy and retries the
  next pick, as router/router.py does.

Multi-step windows are the simulator's speed-up: with ``num_scheduler_steps=1`` (what a GPU
worker runs by default) a worker decodes in windows of up to ``window_steps`` steps, but a window
ends at the first inner step that reaches the next arrival, or when a request finished while
others wait; so every request is admitted at the same step boundary as with one-step scheduling.
``num_scheduler_steps=N > 1`` runs the live engine's fixed N-step windows instead.

Determinism: events are ordered by (time, insertion number); every random draw comes from a
seeded ``random.Random``; nothing iterates a set or hashes a str. The same seed gives the same
results, byte for byte.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvmesh.contract.block_hash import XXH3_128
from kvmesh.contract.types import AllBlocksCleared, BlockStored, KVCacheEvent, Load, SamplingParams
from kvmesh.kv_service.index import Action, Registration
from kvmesh.kv_service.service import KVService, ServiceConfig, run_now
from kvmesh.kv_service.store_memory import MemoryIndex
from kvmesh.model_worker.config import EngineConfig
from kvmesh.model_worker.llm_engine import LLMEngine
from kvmesh.model_worker.scheduler import RequestOutput
from kvmesh.model_worker.sim_runner import DEFAULT_SIM_NUM_BLOCKS, CostModel, SimRunner
from kvmesh.router.core import CountingObserver, RoutePlan, RoutingCore
from kvmesh.router.inflight import Ticket
from kvmesh.router.policy import PolicyConfig, make_policy
from kvmesh.router.upstream import IndexMatch, IndexUnavailable, WorkerEndpoint
from kvmesh.sim.workload import Workload

MODEL_ID = "sim-8b"
PLACEHOLDER_TOKEN = 2
SIM_TOKENS_PER_WORKER = DEFAULT_SIM_NUM_BLOCKS * 16
"""KV capacity of one simulated H100 in tokens (442,368), whatever the block size."""


@dataclass(slots=True)
class SimConfig:
    """One simulated run: the mesh, the live system's delays, the policy, the faults."""

    workers: int = 8
    routers: int = 1
    policy: str = "kv-aware"
    rate: float = 1.0
    """Offered load: the workload's own arrival rate times this."""
    seed: int = 0
    # -- engines
    block_size: int = 64
    """Tokens per KV block. NOTE: 64, not the live default 16, keeps the per-block Python work of
    the real block pool and index a quarter as large (docs/benchmarks.md, simulator speed)."""
    num_blocks: int | None = None
    """Per worker; None = an H100's 442,368 tokens of KV (27,648 blocks of 16) in blocks of ``block_size``."""
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 131_072
    num_scheduler_steps: int = 1
    window_steps: int = 64
    """Longest decode window the simulator runs as one event (only with ``num_scheduler_steps=1``)."""
    cost: CostModel = field(default_factory=CostModel)
    # -- the live system's delays (defaults: the live defaults)
    event_batch_s: float = 0.02
    """kv publisher: one message at most this often (model_worker/kv_publisher.py BATCH_INTERVAL_S)."""
    event_delay_s: float = 0.002
    """A message's trip from the worker to the index."""
    heartbeat_s: float = 10.0 / 3
    """Heartbeats (with the load): every lease / 3 (the publisher's period with the default 10 s lease)."""
    load_on_events: bool = True
    """Event messages carry the load, and a changed load goes out alone (kv_publisher.py); False:
    only heartbeats report load (the live publisher until 2026-11-22; the goal-table runs of
    2026-11-22 ran so)."""
    lease_ttl_s: float = 10.0
    discovery_s: float = 1.0
    """Routers' ListWorkers poll (--discovery-interval)."""
    lookup_latency_s: float = 0.002
    """One Lookup round trip (measured ~2 ms p50 on loopback, docs/benchmarks.md)."""
    lookup_timeout_s: float = 0.05
    """The router's Lookup deadline (--lookup-timeout-ms 50): a slower Lookup fails."""
    index_retry_s: float = 1.0
    network_s: float = 0.001
    """One hop router <-> worker (request out, first token and end of stream back)."""
    speculative_ttl_s: float = 2.0
    max_attempts: int = 3
    unhealthy_s: float = 5.0
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    # -- faults
    event_loss: float = 0.0
    """Share of event messages lost on the way to the index (the next one is then out of order:
    RESYNC, snapshot)."""
    restart_at: Sequence[float] = ()
    """When worker 0 is killed, as fractions of the arrival span (0.5 = mid-trace, at any rate);
    it is back ``restart_down_s`` later with an empty cache and a new epoch."""
    restart_down_s: float = 2.0
    # -- SLO
    slo_ttft_s: float = 2.0
    slo_ttft_prefill_x: float = 2.0
    slo_tpot_s: float = 0.1
    stop_when_slo_lost: bool = False
    """End the run as soon as more than ``1 - slo_target`` of the requests missed the SLO (the
    capacity search only needs to know that attainment fell below the target)."""
    slo_target: float = 0.9

    def blocks_per_worker(self) -> int:
        return self.num_blocks or SIM_TOKENS_PER_WORKER // self.block_size + 1


@dataclass(slots=True)
class RequestRecord:
    """What happened to one request (client view, virtual seconds)."""

    index: int
    arrival: float
    prompt_len: int
    output_len: int
    worker: str = ""
    first_token: float | None = None
    finish: float | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    failed: str = ""
    attempts: int = 0
    slo_ok: bool | None = None
    counted_miss: bool = False
    """Already counted as an SLO miss (its TTFT deadline passed before its first token)."""

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.first_token is None or self.finish is None or self.completion_tokens < 2:
            return None
        return (self.finish - self.first_token) / (self.completion_tokens - 1)


class EventQueue:
    """Events in (time, insertion) order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable, tuple]] = []
        self._n = 0

    def at(self, t: float, fn: Callable, *args) -> None:
        self._n += 1
        heapq.heappush(self._heap, (t, self._n, fn, args))

    def after(self, dt: float, fn: Callable, *args) -> None:
        self.at(self.now + dt, fn, *args)

    def pop(self) -> bool:
        if not self._heap:
            return False
        t, _, fn, args = heapq.heappop(self._heap)
        self.now = t
        fn(*args)
        return True

    def __len__(self) -> int:
        return len(self._heap)


# -- the index ------------------------------------------------------------------------------------
@dataclass(slots=True)
class IndexTraffic:
    """What reached the index in one run: the kv_service's (and its Redis') load, counted where
    the index receives it (lost messages are not counted). docs/deploy.md sizes Redis from it."""

    event_messages: int = 0
    """PublishEvents messages with events or a load (snapshots not included)."""
    load_only_messages: int = 0
    """Of those, the messages with a load and no event."""
    blocks_stored: int = 0
    """Block hashes in BlockStored events (in blocks of the run's block size)."""
    blocks_removed: int = 0
    all_cleared: int = 0
    max_message_blocks: int = 0
    """The most block hashes one message carried."""
    snapshots: int = 0
    snapshot_blocks: int = 0
    heartbeats: int = 0
    routed_requests: int = 0
    """Requests a router planned (one per request; retries are not planned again)."""
    lookups: int = 0
    """Lookups the routers asked (those past the router's deadline included: the index served them)."""
    lookup_chain_blocks: int = 0
    """Block hashes in those Lookups' chains."""

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


class SimIndex:
    """KVService over MemoryIndex on the virtual clock, with the router's Lookup deadline."""

    def __init__(self, q: EventQueue, cfg: SimConfig) -> None:
        self.q = q
        self.cfg = cfg
        self.svc = KVService(MemoryIndex(), ServiceConfig(lease_ttl_ms=int(cfg.lease_ttl_s * 1000)),
                             clock=lambda: int(q.now * 1000))
        self.traffic = IndexTraffic()

    def lookup(self, model_id: str, chain: Sequence[bytes]) -> list[IndexMatch]:
        self.traffic.lookups += 1
        self.traffic.lookup_chain_blocks += len(chain)
        if self.cfg.lookup_latency_s > self.cfg.lookup_timeout_s:
            raise IndexUnavailable("Lookup past its deadline (simulated)")
        return [IndexMatch(m.worker_id, m.address, m.matched_blocks, m.load)
                for m in run_now(self.svc.lookup(model_id, chain))]

    def endpoints(self) -> list[WorkerEndpoint]:
        """ListWorkers: the live workers of the model, with their last reported load."""
        now_ms = int(self.q.now * 1000)
        return [WorkerEndpoint(w.registration.worker_id, w.registration.address, w.load)
                for w in run_now(self.svc.index.workers(now_ms)) if w.registration.model_id == MODEL_ID]


# -- workers --------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Attempt:
    """One request on one worker."""

    record: RequestRecord
    router: SimRouter
    plan: RoutePlan
    ticket: Ticket
    request_id: str
    tried: list[str]


class SimWorker:
    """A worker: the real engine on the virtual clock, its publisher and heartbeat modelled."""

    def __init__(self, mesh: Mesh, index: int) -> None:
        self.mesh = mesh
        self.worker_id = f"worker-{index:03d}"
        self.address = f"sim:{50061 + index}"
        self.epoch = 0
        self.up = False
        self.engine: LLMEngine | None = None
        self.runner: SimRunner | None = None
        self.busy_until = 0.0
        self.stepping = False
        self.attempts: dict[str, _Attempt] = {}
        self._pre_stats = None
        # publisher state
        self.seq = 0
        self.queued: list[KVCacheEvent] = []
        self.flush_at: float | None = None
        """When the next message is due (None: none due)."""
        self.sent_state: tuple[int, ...] | None = None
        self.last_sent = -1.0
        self.need_snapshot = False
        self.resyncs = 0
        self.busy_s = 0.0
        self._step_start = 0.0

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.mesh.cfg
        runner_box: list[SimRunner] = []

        def factory(config, model_config) -> SimRunner:
            runner_box.append(SimRunner(config, model_config, cfg.cost, time_scale=0.0))
            return runner_box[0]

        steps = cfg.num_scheduler_steps if cfg.num_scheduler_steps > 1 else cfg.window_steps
        self.engine = LLMEngine(EngineConfig(
            model=str(self.mesh.model_dir), model_id=MODEL_ID, block_size=cfg.block_size,
            num_blocks=cfg.blocks_per_worker(), max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs, max_model_len=cfg.max_model_len, hash_algorithm=XXH3_128,
            num_scheduler_steps=steps), runner_factory=factory)
        self.runner = runner_box[0]
        self.runner.batch_windows = True
        if cfg.num_scheduler_steps == 1:
            engine = self.engine
            self.runner.stop_window_on_exit = lambda: engine.scheduler.num_waiting > 0
        self.epoch += 1
        self.up = True
        self.seq = 0
        self.queued = []
        self.need_snapshot = False
        svc = self.mesh.index.svc
        run_now(svc.register(Registration(self.worker_id, self.address, MODEL_ID, cfg.block_size, XXH3_128,
                                          self.engine.kv_cache_manager.num_blocks, self.epoch)))
        # NOTE: seq 1 of a new registration: the index starts empty for this epoch (kv_publisher).
        self._enqueue([AllBlocksCleared()])

    def kill(self) -> None:
        """The process dies: in-flight streams break, the engine and its cache are gone."""
        self.up = False
        self.engine = self.runner = None
        self.stepping = False
        self.flush_at = None
        attempts, self.attempts = self.attempts, {}
        for a in attempts.values():
            self.mesh.q.after(self.mesh.cfg.network_s, a.router.worker_failed, a, self.worker_id)

    # -- requests ----------------------------------------------------------------------------------
    def submit(self, a: _Attempt) -> None:
        if not self.up:
            self.mesh.q.after(self.mesh.cfg.network_s, a.router.worker_failed, a, self.worker_id)
            return
        r = self.mesh.workload.requests[a.record.index]
        assert self.engine is not None
        # NOTE: the chain is the real one (the workload's tokens hashed once per sweep); the ids
        # handed to the engine are placeholders of the right length: a simulated forward pass reads
        # none, and they only ever feed the hashes of generated blocks, which no prompt shares.
        try:
            self.engine.add_request(a.request_id, [PLACEHOLDER_TOKEN] * r.prompt_len,
                                    SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                                    block_hashes=self.mesh.chains[r.index], validate_tokens=False)
        except ValueError as exc:
            # NOTE: what a live worker answers INVALID_ARGUMENT to (e.g. longer than max_model_len):
            # the router does not retry it, the request fails.
            self.mesh.q.after(self.mesh.cfg.network_s, a.router.refused, a, str(exc))
            return
        self.attempts[a.request_id] = a
        if not self.stepping:
            self._step()
        self._load_changed()

    # -- the step loop -----------------------------------------------------------------------------
    def _step(self) -> None:
        engine = self.engine
        assert engine is not None and self.runner is not None
        now = self.mesh.q.now
        self._pre_stats = engine.last_step_stats  # NOTE: replaced, never mutated, at the step's end
        self._step_start = now
        self.stepping = True
        if self.mesh.cfg.num_scheduler_steps == 1:
            # NOTE: windows end where one-step scheduling would admit a request: at the next
            # arrival, or (stop_window_on_exit) when a request finished while others wait.
            self.runner.window_deadline_s = self.mesh.next_delivery - now
        engine.step(on_output=self._on_output)
        d = engine.last_step_s
        if d <= 0 and engine.has_unfinished_requests():
            # NOTE: the scheduler always makes progress while it has work; a step that ran nothing
            # would spin at one virtual instant forever.
            raise RuntimeError(f"{self.worker_id}: a step scheduled nothing with requests pending")
        self.busy_s += d
        self.busy_until = now + d
        self.mesh.q.at(self.busy_until, self._step_done, self.epoch)

    def _on_output(self, outputs: list[RequestOutput]) -> None:
        runner = self.runner
        assert runner is not None
        start, step_t, rows = self._step_start, runner.step_elapsed_s, runner.row_elapsed_s
        q, hop = self.mesh.q, self.mesh.cfg.network_s
        for o in outputs:
            a = self.attempts.get(o.request_id)
            if a is None:
                continue
            # NOTE: in a window each request's last token has its own time.
            t = start + rows.get(o.request_id, step_t)
            rec = a.record
            if o.new_token_ids:
                if rec.first_token is None:
                    rec.first_token = t + hop
                    rec.cached_tokens = max(o.num_cached_tokens, 0)
                    q.at(t + hop, a.router.first_token, a)
                rec.completion_tokens += len(o.new_token_ids)
            if o.finished:
                rec.finish = t + hop
                del self.attempts[o.request_id]
                q.at(t + hop, a.router.finished, a)

    def _step_done(self, epoch: int) -> None:
        if epoch != self.epoch or not self.up:
            return  # NOTE: a step of a killed incarnation
        engine = self.engine
        assert engine is not None
        events = engine.take_kv_events()
        if events:
            self._enqueue(events)
        else:
            self._load_changed()
        if self.need_snapshot:
            self._send_snapshot()
        if engine.has_unfinished_requests():
            self._step()
        else:
            self.stepping = False

    # -- kv publisher ------------------------------------------------------------------------------
    def _enqueue(self, events: list[KVCacheEvent]) -> None:
        if self.need_snapshot:
            return  # the coming snapshot supersedes these
        self.queued.extend(events)
        self._flush_by(self.last_sent + self.mesh.cfg.event_batch_s)

    def _load_changed(self) -> None:
        """The load may have changed with no events to carry it: a load-only message is due in the
        next message slot (the live publisher's queue wait times out after one batch interval)."""
        if self.mesh.cfg.load_on_events and not self.need_snapshot:
            self._flush_by(self.last_sent + self.mesh.cfg.event_batch_s)

    def _flush_by(self, t: float) -> None:
        t = max(self.mesh.q.now, t)
        if self.flush_at is None or t < self.flush_at:
            self.flush_at = t
            self.mesh.q.at(t, self._flush, self.epoch, t)

    def _flush(self, epoch: int, at: float) -> None:
        if epoch != self.epoch or not self.up or at != self.flush_at:
            return  # NOTE: a killed incarnation's, or superseded by an earlier one
        self.flush_at = None
        mesh = self.mesh
        load = self.load_now() if mesh.cfg.load_on_events else None
        if not self.queued and (load is None or self.need_snapshot or load.queue_state() == self.sent_state):
            return
        events, self.queued = self.queued, []
        if load is not None:
            self.sent_state = load.queue_state()
        self.seq += 1
        self.last_sent = mesh.q.now
        if mesh.cfg.event_loss and mesh.rng.random() < mesh.cfg.event_loss:
            mesh.lost_batches += 1
            return
        mesh.q.after(mesh.cfg.event_delay_s, self._deliver, self.epoch, self.seq, events, load)

    def _deliver(self, epoch: int, seq: int, events: list[KVCacheEvent], load: Load | None) -> None:
        if epoch != self.epoch:
            return  # NOTE: a killed incarnation's stream died with it
        self._count(events)
        result = run_now(self.mesh.index.svc.publish(self.worker_id, epoch, seq, events, load))
        if result.action == Action.RESYNC and epoch == self.epoch and self.up:
            self.resyncs += 1
            # NOTE: the ack travels back; then the engine loop takes the snapshot at its next sync.
            self.mesh.q.after(self.mesh.cfg.event_delay_s, self._resync)

    def _count(self, events: list[KVCacheEvent]) -> None:
        t = self.mesh.index.traffic
        t.event_messages += 1
        if not events:
            t.load_only_messages += 1
        n = 0
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                t.all_cleared += 1
                continue
            n += len(ev.block_hashes)
            if isinstance(ev, BlockStored):
                t.blocks_stored += len(ev.block_hashes)
            else:
                t.blocks_removed += len(ev.block_hashes)
        t.max_message_blocks = max(t.max_message_blocks, n)

    def _resync(self) -> None:
        if not self.up:
            return
        self.need_snapshot = True
        self.queued = []
        if not self.stepping:
            self._send_snapshot()

    def _send_snapshot(self) -> None:
        assert self.engine is not None
        self.need_snapshot = False
        # NOTE: the pool's map in insertion order (oldest cached first): deterministic, unlike a set.
        hashes = list(self.engine.kv_cache_manager.block_pool.cached_block_hash_to_block)
        self.seq += 1
        self.last_sent = self.mesh.q.now
        load = self.load_now() if self.mesh.cfg.load_on_events else None
        if load is not None:
            self.sent_state = load.queue_state()
        self.mesh.q.after(self.mesh.cfg.event_delay_s, self._deliver_snapshot, self.epoch, self.seq, hashes, load)

    def _deliver_snapshot(self, epoch: int, seq: int, hashes: list[bytes], load: Load | None) -> None:
        if epoch == self.epoch:
            t = self.mesh.index.traffic
            t.snapshots += 1
            t.snapshot_blocks += len(hashes)
            run_now(self.mesh.index.svc.snapshot(self.worker_id, epoch, seq, hashes, load))

    def load_now(self) -> Load:
        """The load the live worker would report now."""
        assert self.engine is not None
        # NOTE: mid-step the live engine reports the state as of the step's start plus what
        # arrived since (its snapshot is taken between steps).
        stats = self.engine.stats()
        if self.stepping and self.mesh.q.now < self.busy_until and self._pre_stats is not None:
            pre, post = self._pre_stats, self.engine.last_step_stats
            stats = replace(pre, num_waiting=pre.num_waiting + stats.num_waiting - post.num_waiting,
                            queued_prefill_tokens=pre.queued_prefill_tokens + stats.queued_prefill_tokens
                            - post.queued_prefill_tokens)
        return stats.load

    def heartbeat(self) -> None:
        if self.up and self.engine is not None:
            self.mesh.index.traffic.heartbeats += 1
            run_now(self.mesh.index.svc.heartbeat(self.worker_id, self.epoch, self.load_now()))
        self.mesh.q.after(self.mesh.cfg.heartbeat_s, self.heartbeat)


# -- routers --------------------------------------------------------------------------------------
class SimRouter:
    """One router: RoutingCore + policy, discovery by polling the index, retries as router.py."""

    def __init__(self, mesh: Mesh, index: int) -> None:
        self.mesh = mesh
        cfg = mesh.cfg
        pc = PolicyConfig(**{f: getattr(cfg.policy_config, f) for f in PolicyConfig.__dataclass_fields__})
        pc.seed = cfg.seed * 1000 + index
        pc.clock = lambda: mesh.q.now
        self.observer = CountingObserver()
        self.core = RoutingCore(make_policy(cfg.policy, pc), speculative_ttl_s=cfg.speculative_ttl_s,
                                index_retry_s=cfg.index_retry_s, clock=lambda: mesh.q.now, observer=self.observer)
        self.endpoints: list[WorkerEndpoint] = []
        self.unhealthy: dict[str, float] = {}
        self.spec = mesh.spec

    def discover(self) -> None:
        self.endpoints = self.mesh.index.endpoints()
        self.mesh.q.after(self.mesh.cfg.discovery_s, self.discover)

    def healthy(self, worker_id: str) -> bool:
        until = self.unhealthy.get(worker_id)
        return until is None or self.mesh.q.now >= until

    def route(self, rec: RequestRecord) -> None:
        mesh = self.mesh
        mesh.index.traffic.routed_requests += 1
        chain = mesh.chains[rec.index]
        plan = self.core.plan(self.spec, _Length(rec.prompt_len), self.endpoints, mesh.index, chain=chain,
                              healthy=self.healthy, max_tokens=rec.output_len)
        if not plan.candidates:
            rec.failed = "no worker"
            mesh.request_done(rec)
            return
        delay = mesh.cfg.lookup_latency_s if self.core.wants_index(chain) and plan.query.index_ok else 0.0
        self._send(rec, plan, plan.candidates, [], delay)

    def _send(self, rec: RequestRecord, plan: RoutePlan, candidates, tried: list[str], delay: float) -> None:
        decision = self.core.pick(plan, candidates)
        ticket = self.core.start(plan, decision.worker_id)
        rec.attempts += 1
        rec.worker = decision.worker_id
        a = _Attempt(rec, self, plan, ticket, f"r{rec.index}.{rec.attempts}", [*tried, decision.worker_id])
        worker = self.mesh.workers_by_id[decision.worker_id]
        self.mesh.q.after(delay + self.mesh.cfg.network_s, worker.submit, a)

    def first_token(self, a: _Attempt) -> None:
        self.core.prefilled(a.ticket)

    def finished(self, a: _Attempt) -> None:
        self.core.finish(a.ticket)
        self.mesh.request_done(a.record)

    def refused(self, a: _Attempt, why: str) -> None:
        """INVALID_ARGUMENT from the worker: never retried."""
        self.core.finish(a.ticket)
        a.record.failed = f"refused: {why}"
        self.mesh.request_done(a.record)

    def worker_failed(self, a: _Attempt, worker_id: str) -> None:
        """UNAVAILABLE from the worker: before the first token retry elsewhere, after it fail."""
        self.core.finish(a.ticket)
        self.unhealthy[worker_id] = self.mesh.q.now + self.mesh.cfg.unhealthy_s
        rec = a.record
        if rec.first_token is not None:
            rec.failed = f"worker {worker_id} failed mid-stream"
            self.mesh.request_done(rec)
            return
        remaining = [c for c in a.plan.candidates if c.worker_id not in a.tried]
        if not remaining or rec.attempts >= self.mesh.cfg.max_attempts:
            rec.failed = f"no worker could take it after {rec.attempts} attempt(s)"
            self.mesh.request_done(rec)
            return
        self._send(rec, a.plan, remaining, a.tried, 0.0)


class _Length:
    """A prompt the router only measures: the simulator hands it the chain, never the tokens."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


# -- the mesh -------------------------------------------------------------------------------------
class Mesh:
    """One run: workers, index, routers and the workload's arrivals on one event queue."""

    def __init__(self, cfg: SimConfig, workload: Workload, model_dir: Path,
                 chains: list[list[bytes]], progress: Callable[[float], None] | None = None) -> None:
        self.cfg = cfg
        self.workload = workload
        self.model_dir = model_dir
        self.chains = chains
        self.q = EventQueue()
        self.rng = random.Random(cfg.seed)
        from kvmesh.contract.types import ModelSpec

        self.spec = ModelSpec(MODEL_ID, cfg.block_size, XXH3_128)
        self.index = SimIndex(self.q, cfg)
        self.workers = [SimWorker(self, i) for i in range(cfg.workers)]
        self.workers_by_id = {w.worker_id: w for w in self.workers}
        self.routers = [SimRouter(self, i) for i in range(cfg.routers)]
        self.records: list[RequestRecord] = []
        self.lost_batches = 0
        self.done = 0
        self.slo_missed = 0
        self.stopped_early = False
        self._progress = progress
        self._arrivals = [r.arrival_s / cfg.rate for r in workload.requests]
        self._next = 0
        self.next_delivery = 0.0

    def run(self) -> list[RequestRecord]:
        cfg, q = self.cfg, self.q
        for w in self.workers:
            w.start()
        n = cfg.workers
        for i, w in enumerate(self.workers):
            # NOTE: staggered like independent processes; all report once before the first arrival.
            q.at(i * cfg.heartbeat_s / n, w.heartbeat)
        for r in self.routers:
            q.at(0.0, r.discover)
        span = self._arrivals[-1] - self._arrivals[0] if self._arrivals else 0.0
        for frac in cfg.restart_at:
            q.at(self._arrivals[0] + frac * span, self._restart, self.workers[0])
        self.records = [RequestRecord(r.index, self._arrivals[r.index], r.prompt_len, r.output_len)
                        for r in self.workload.requests]
        self._schedule_next_arrival()
        total = len(self.records)
        while self.done < total and q.pop():
            if self.stopped_early:
                break
        return self.records

    def _schedule_next_arrival(self) -> None:
        if self._next < len(self._arrivals):
            t = self._arrivals[self._next]
            self.q.at(t, self._arrive, self._next)
            self.next_delivery = t + self.cfg.lookup_latency_s + self.cfg.network_s
        else:
            self.next_delivery = float("inf")

    def _arrive(self, i: int) -> None:
        self._next = i + 1
        self._schedule_next_arrival()
        rec = self.records[i]
        if self.cfg.stop_when_slo_lost:
            self.q.after(self.ttft_limit(rec.prompt_len), self._ttft_deadline, rec)
        self.routers[i % len(self.routers)].route(rec)
        if self._progress is not None and i % 50 == 0:
            self._progress(i / len(self.records))

    def _restart(self, w: SimWorker) -> None:
        w.kill()
        self.q.after(self.cfg.restart_down_s, w.start)

    def request_done(self, rec: RequestRecord) -> None:
        self.done += 1
        rec.slo_ok = self.meets_slo(rec)
        if not rec.slo_ok and not rec.counted_miss:
            self._miss(rec)

    def _ttft_deadline(self, rec: RequestRecord) -> None:
        """Early stop: a request without its first token at its TTFT limit has missed the SLO."""
        if rec.first_token is None and not rec.counted_miss and rec.slo_ok is None:
            self._miss(rec)

    def _miss(self, rec: RequestRecord) -> None:
        rec.counted_miss = True
        self.slo_missed += 1
        if self.cfg.stop_when_slo_lost and self.slo_missed > (1 - self.cfg.slo_target) * len(self.records):
            self.stopped_early = True

    def cold_prefill_s(self, prompt_len: int) -> float:
        """The request's prefill alone on an idle worker, chunked as the engine chunks it."""
        c, budget, t, start = self.cfg.cost, self.cfg.max_num_batched_tokens, 0.0, 0
        while start < prompt_len:
            n = min(budget, prompt_len - start)
            t += c.step_time([(start, n)], [])
            start += n
        return t

    def ttft_limit(self, prompt_len: int) -> float:
        return self.cfg.slo_ttft_s + self.cfg.slo_ttft_prefill_x * self.cold_prefill_s(prompt_len)

    def meets_slo(self, rec: RequestRecord) -> bool:
        if rec.failed or rec.ttft is None:
            return False
        if rec.ttft > self.ttft_limit(rec.prompt_len):
            return False
        tpot = rec.tpot
        return tpot is None or tpot <= self.cfg.slo_tpot_s
