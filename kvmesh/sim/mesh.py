"""The mesh in virtual time: one process, one event queue, no threads, sockets or sleeps.

What runs is the production code; only the forward pass and the wire are modelled:

- **workers**: each one a real :class:`LLMEngine` (scheduler, block pool, prefix cache, chunked
  prefill, multi-step windows, block events) whose runner is the simulated one
  (model_worker/sim_runner.py) with ``time_scale=0``: a step *returns* its modelled duration
  and the worker is busy that long on the virtual clock. Its kv publisher and heartbeat are
  modelled after kvmesh/transport/kv_publisher.py: block events are merged into one message at most
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
  next pick, as router/router.py does. Peers with a multi-router mode of their own run in it
  (kvmesh/sim/replicas.py: Dynamo's replica sync, llm-d's per-router load scrapes).

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
from kvmesh.contract.errors import NotFound
from kvmesh.contract.settings import code_only, flag
from kvmesh.contract.types import AllBlocksCleared, BlockStored, KVCacheEvent, Load, SamplingParams
from kvmesh.kv_service.config import ServiceConfig
from kvmesh.kv_service.index import Action, Pick, Registration
from kvmesh.kv_service.service import KVService, run_now
from kvmesh.kv_service.store_memory import MemoryIndex
from kvmesh.model_worker.config import EngineConfig
from kvmesh.model_worker.llm_engine import LLMEngine
from kvmesh.model_worker.request import Request
from kvmesh.model_worker.scheduler import RequestOutput, SchedulerConfig
from kvmesh.model_worker.step_time import StepTimeConfig, StepTimeModel, gpu_spec
from kvmesh.router.attempts import Attempts
from kvmesh.router.config import RoutingConfig
from kvmesh.router.core import CountingObserver, RoutePlan, RoutingCore
from kvmesh.router.inflight import Ticket
from kvmesh.router.policies import make_policy
from kvmesh.router.policies.base import Decision
from kvmesh.router.upstream import Claim, ClaimAnswer, Failure, IndexMatch, IndexUnavailable, WorkerEndpoint
from kvmesh.router.worker_set import WorkerSet
from kvmesh.sim.engine import WindowRunner, WindowScheduler
from kvmesh.sim.fleet import parse_fleet
from kvmesh.sim.replicas import PeerModes
from kvmesh.sim.workload import Workload
from kvmesh.transport.event_batcher import BATCH_INTERVAL_S, EventBatcher, Message

MODEL_ID = "sim-8b"
PLACEHOLDER_TOKEN = 2


def _sim_engine() -> SchedulerConfig:
    return SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=131_072)


@dataclass(slots=True)
class SimConfig:
    """One simulated run: the mesh, the live system's settings and delays, the faults, the SLO.

    Where a setting is the live system's (the routers' RoutingConfig, the engines' SchedulerConfig,
    the publisher's batching interval, the kv_service's lease), it is that declaration, with that
    flag name; `kvmesh simulate` derives every flag from these fields.
    """

    workers: str = flag("8", metavar="N|NxGPU,...")
    """Simulated workers: N of --sim-gpu, or a fleet of GPU types, e.g. 4xH100,4xA100 (kvmesh/sim/fleet.py;
    an int is taken as N)."""
    routers: int = 1
    """Routers sharing the index; arrivals are dealt to them in turn, each with its own in-flight view."""
    replica_sync: bool = True
    """With --routers > 1, a policy whose original syncs its replicas runs in that mode (dynamo:
    --router-replica-sync, active-sequence events batched 1 ms; kvmesh/sim/replicas.py); off: each router's
    state stays its own."""
    seed: int = 0
    """Seeds the token synthesis, the policies' tie-breaks and the faults."""
    rate: float = code_only(1.0)
    """Offered load: the workload's own arrival rate times this (set per run)."""
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    """The routers' settings: the live router's (a group: its fields are the flags)."""
    # -- engines
    engine: SchedulerConfig = field(default_factory=_sim_engine)
    """The engines' scheduling: the live worker's settings (a group), an H100's defaults."""
    block_size: int = 64
    """Tokens per KV block (the live default is 16: 64 keeps the Python work per block of the real block
    pool and index a quarter as large; docs/benchmarks.md, simulator speed)."""
    num_blocks: int | None = None
    """KV blocks per worker; none = what each worker's GPU holds (an H100: 442,368 tokens, 27,648 blocks of 16)
    in blocks of --block-size."""
    window_steps: int = 64
    """Longest decode window simulated as one event with --num-scheduler-steps 1 (kvmesh/sim/engine.py)."""
    step_time: StepTimeConfig = field(default_factory=StepTimeConfig)
    """The workers' step time: model, GPU, noise (a group: --sim-cost-model, --sim-gpu, --sim-step-noise)."""
    cost: StepTimeModel | None = code_only(None)
    """One step-time model for every worker instead of each one's GPU (the linear model of the --sim-*
    coefficients; a toy model in tests)."""
    # -- the live system's delays
    event_batch_s: float = flag(BATCH_INTERVAL_S, name="event-batch-interval")
    """Seconds between two event messages of a worker, at least (the live publisher's)."""
    event_delay_s: float = flag(0.002, name="event-delay")
    """Seconds an event message takes from the worker to the index."""
    load_reports: str = "events"
    """events: event messages carry the load and a changed load goes out alone (the live worker);
    heartbeat: only heartbeats report it (the worker until 2026-11-22)."""
    index: ServiceConfig = field(default_factory=ServiceConfig)
    """The kv_service's settings (a group: --lease-ttl-ms, workers heartbeat every third of it as the live
    publisher does; the routers' picks, --pending-*)."""
    lookup_latency_s: float = flag(0.002, name="lookup-latency")
    """Seconds of one Lookup round trip (measured ~2 ms p50 on loopback, docs/benchmarks.md)."""
    reserve_latency_s: float = flag(0.001, name="reserve-latency")
    """Seconds of one Reserve round trip of the shared router view; the pick lands in the index halfway.
    Measured live 0.71 ms p50, 3.8 ms p99 (benchmarks/reserve_latency.py, docs/router.md "Several
    routers"); 1 ms rounds it up, so the window in which two routers' claims race is not shorter than live."""
    network_s: float = flag(0.001, name="network-delay")
    """Seconds of one hop router <-> worker (request out, first token and end of stream back)."""
    # -- faults
    event_loss: float = 0.0
    """Share of event messages lost on the way to the index (the next one is then out of order: RESYNC,
    snapshot)."""
    restart_at: list[float] = field(default_factory=list)
    """When worker 0 is killed, as fractions of the arrival span (0.5 = mid-trace, at any rate); it is back
    --restart-down later with an empty cache and a new epoch."""
    restart_down_s: float = flag(2.0, name="restart-down")
    """Seconds a restarted worker stays down."""
    # -- SLO
    slo_ttft_s: float = flag(2.0, name="slo-ttft")
    """TTFT limit: this many seconds ..."""
    slo_ttft_prefill_x: float = 2.0
    """... plus this many times the request's own cold prefill time on the cost model."""
    slo_tpot_s: float = flag(0.1, name="slo-tpot")
    """Mean TPOT limit in seconds."""
    slo_target: float = 0.9
    """Capacity = the highest rate with at least this share of requests meeting the SLO."""
    stop_when_slo_lost: bool = code_only(False)
    """End the run as soon as more than ``1 - slo_target`` of the requests missed the SLO (the
    capacity search only needs to know that attainment fell below the target)."""

    def __post_init__(self) -> None:
        if isinstance(self.workers, int):
            self.workers = str(self.workers)

    @property
    def policy(self) -> str:
        return self.routing.policy

    def worker_gpus(self) -> list[str]:
        """Each worker's GPU type, in worker order."""
        return parse_fleet(self.workers, self.step_time.gpu)

    @property
    def num_workers(self) -> int:
        return len(self.worker_gpus())

    def cost_for(self, gpu: str) -> StepTimeModel:
        """The step-time model of a worker on ``gpu``."""
        return self.cost if self.cost is not None else self.step_time.model(gpu)

    @property
    def load_on_events(self) -> bool:
        return self.load_reports == "events"

    @property
    def heartbeat_s(self) -> float:
        return self.index.lease_ttl_ms / 1000 / 3

    def check(self) -> None:
        """Raises ValueError with the flag to fix."""
        if self.routers < 1:
            raise ValueError("--routers must be >= 1")
        self.step_time.check()
        for gpu in dict.fromkeys(self.worker_gpus()):
            self.cost_for(gpu)
        if not 0 <= self.event_loss < 1:
            raise ValueError(f"--event-loss must be in [0, 1), got {self.event_loss}")
        if not all(0 <= f <= 1 for f in self.restart_at):
            raise ValueError("--restart-at takes fractions in [0, 1]")
        if self.load_reports not in ("events", "heartbeat"):
            raise ValueError(f"--load-reports must be events or heartbeat, got {self.load_reports!r}")
        self.routing.check()
        self.engine.validate()

    def blocks_per_worker(self, gpu: str | None = None) -> int:
        """KV blocks of a worker on ``gpu`` (default: --sim-gpu): --num-blocks, or what the GPU holds."""
        return self.num_blocks or gpu_spec(gpu or self.step_time.gpu).kv_tokens() // self.block_size + 1


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
    reserves: int = 0
    """Reserve calls of the shared router view (the refused ones included)."""

    def as_dict(self) -> dict:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}


class SimIndex:
    """KVService over MemoryIndex on the virtual clock, with the router's Lookup deadline."""

    def __init__(self, q: EventQueue, cfg: SimConfig) -> None:
        self.q = q
        self.cfg = cfg
        self.svc = KVService(MemoryIndex(), cfg.index,
                             clock=lambda: int(q.now * 1000))
        self.traffic = IndexTraffic()

    def lookup(self, model_id: str, chain: Sequence[bytes]) -> list[IndexMatch]:
        self.traffic.lookups += 1
        self.traffic.lookup_chain_blocks += len(chain)
        if self.cfg.lookup_latency_s * 1000 > self.cfg.routing.lookup_timeout_ms:
            raise IndexUnavailable("Lookup past its deadline (simulated)")
        return [IndexMatch(m.worker_id, m.address, m.matched_blocks, m.load, m.pending)
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
    attempts: Attempts
    ticket: Ticket
    request_id: str


class SimWorker:
    """A worker: the real engine on the virtual clock, its publisher and heartbeat modelled."""

    def __init__(self, mesh: Mesh, index: int, gpu: str) -> None:
        self.mesh = mesh
        self.index = index
        self.gpu = gpu
        """Its GPU type: the step-time model and KV capacity it runs with (nothing it reports names it)."""
        self.worker_id = f"worker-{index:03d}"
        self.address = f"sim:{50061 + index}"
        self.epoch = 0
        self.up = False
        self.engine: LLMEngine | None = None
        self.runner: WindowRunner | None = None
        self.busy_until = 0.0
        self.stepping = False
        self.attempts: dict[str, _Attempt] = {}
        self._pre_stats = None
        self._step_admitted: list = []
        # the publisher: the live one's batching core on the virtual clock
        self.batcher = EventBatcher()
        self.flush_at: float | None = None
        """When the next message is due (None: none due)."""
        self.resyncs = 0
        self.busy_s = 0.0
        self._step_start = 0.0

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.mesh.cfg
        runner_box: list[WindowRunner] = []

        def factory(config, model_config) -> WindowRunner:
            # NOTE: the noise is seeded per worker and incarnation: the same seed, the same steps.
            runner_box.append(WindowRunner(config, model_config, cfg.cost_for(self.gpu), time_scale=0.0,
                                           noise_sigma=cfg.step_time.step_noise,
                                           noise_seed=(cfg.seed * 4099 + self.index) * 131 + self.epoch))
            return runner_box[0]

        e = cfg.engine
        steps = e.num_scheduler_steps if e.num_scheduler_steps > 1 else cfg.window_steps
        self.engine = LLMEngine(EngineConfig(
            model=str(self.mesh.model_dir), model_id=MODEL_ID, block_size=cfg.block_size,
            num_blocks=cfg.blocks_per_worker(self.gpu), max_num_batched_tokens=e.max_num_batched_tokens,
            max_num_seqs=e.max_num_seqs, max_model_len=e.max_model_len, enable_chunked_prefill=e.enable_chunked_prefill,
            hash_algorithm=XXH3_128, num_scheduler_steps=steps), runner_factory=factory, scheduler_factory=WindowScheduler)
        self.runner = runner_box[0]
        if e.num_scheduler_steps == 1:
            engine = self.engine
            self.runner.stop_window_on_exit = lambda: engine.scheduler.num_waiting > 0
        self.epoch += 1
        self.up = True
        # NOTE: a new process, a new publisher (kvmesh/transport/kv_publisher.py).
        self.batcher = EventBatcher(cfg.event_batch_s, load_reports=cfg.load_on_events)
        svc = self.mesh.index.svc
        run_now(svc.register(Registration(self.worker_id, self.address, MODEL_ID, cfg.block_size, XXH3_128,
                                          self.engine.kv_cache_manager.num_blocks, self.epoch)))
        # NOTE: its first message: the index starts empty for this epoch.
        self.batcher.register()
        self._flush_by(self.batcher.next_due())

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
            self.engine.submit(Request(a.request_id, [PLACEHOLDER_TOKEN] * r.prompt_len,
                                       SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                                       block_hasher=self.engine.block_hasher, block_hashes=self.mesh.chains[r.index]))
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
        # NOTE: what the step drains from the inbox: the live engine counts these in its reports
        # for the whole step (LLMEngine._drained); here the step's end state is computed at its start.
        self._step_admitted = engine.queued_requests()
        self._step_start = now
        self.stepping = True
        if self.mesh.cfg.engine.num_scheduler_steps == 1:
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
        if self.batcher.need_snapshot:
            self._send_snapshot()
        if engine.has_unfinished_requests():
            self._step()
        else:
            self.stepping = False

    # -- kv publisher ------------------------------------------------------------------------------
    def _enqueue(self, events: list[KVCacheEvent]) -> None:
        if self.batcher.add(events):
            self._flush_by(self.batcher.next_due())

    def _load_changed(self) -> None:
        """The load may have changed with no events to carry it: a load-only message may be due in
        the next message slot (the live publisher looks again after each slot)."""
        if self.batcher.load_reports and not self.batcher.need_snapshot:
            self._flush_by(self.batcher.next_due())

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
        msg = self.batcher.take(mesh.q.now, self.load_now() if self.batcher.load_reports else None)
        if msg is None:
            return
        if mesh.cfg.event_loss and mesh.rng.random() < mesh.cfg.event_loss:
            mesh.lost_batches += 1
            return
        mesh.q.after(mesh.cfg.event_delay_s, self._deliver, self.epoch, msg)

    def _deliver(self, epoch: int, msg: Message) -> None:
        if epoch != self.epoch:
            return  # NOTE: a killed incarnation's stream died with it
        svc = self.mesh.index.svc
        if msg.snapshot is not None:
            t = self.mesh.index.traffic
            t.snapshots += 1
            t.snapshot_blocks += len(msg.snapshot)
            run_now(svc.snapshot(self.worker_id, epoch, msg.seq, msg.snapshot, msg.load))
            if msg.load is not None and msg.load.admitted:
                self.mesh.q.after(self.mesh.cfg.event_delay_s, self._ack_admitted, epoch, msg.load.admitted)
            return
        self._count(msg.events)
        result = run_now(svc.publish(self.worker_id, epoch, msg.seq, msg.events, msg.load))
        if result.action == Action.ACK and msg.load is not None and msg.load.admitted:
            self.mesh.q.after(self.mesh.cfg.event_delay_s, self._ack_admitted, epoch, msg.load.admitted)
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

    def _ack_admitted(self, epoch: int, admitted: tuple[str, ...]) -> None:
        if epoch == self.epoch and self.engine is not None:
            self.engine.ack_admitted(admitted)

    def _resync(self) -> None:
        if not self.up:
            return
        self.batcher.resync()
        if not self.stepping:
            self._send_snapshot()

    def _send_snapshot(self) -> None:
        assert self.engine is not None
        # NOTE: the pool's map in insertion order (oldest cached first): deterministic, unlike a set.
        hashes = list(self.engine.kv_cache_manager.block_pool.cached_block_hash_to_block)
        msg = self.batcher.take_snapshot(self.mesh.q.now, hashes,
                                         self.load_now() if self.batcher.load_reports else None)
        self.mesh.q.after(self.mesh.cfg.event_delay_s, self._deliver, self.epoch, msg)

    def load_now(self) -> Load:
        """The load the live worker would report now."""
        assert self.engine is not None
        # NOTE: mid-step the live engine reports the state as of the step's start plus what
        # arrived since (its snapshot is taken between steps).
        stats = self.engine.stats()
        if self.stepping and self.mesh.q.now < self.busy_until and self._pre_stats is not None:
            pre, post, taken = self._pre_stats, self.engine.last_step_stats, self._step_admitted
            stats = replace(pre, num_waiting=pre.num_waiting + len(taken) + stats.num_waiting - post.num_waiting,
                            queued_prefill_tokens=pre.queued_prefill_tokens + sum(r.num_tokens for r in taken)
                            + stats.queued_prefill_tokens - post.queued_prefill_tokens)
        return self.engine.report_load(stats)

    def heartbeat(self) -> None:
        if self.up and self.engine is not None:
            self.mesh.index.traffic.heartbeats += 1
            load = self.load_now()
            run_now(self.mesh.index.svc.heartbeat(self.worker_id, self.epoch, load))
            self.engine.ack_admitted(load.admitted)
        self.mesh.q.after(self.mesh.cfg.heartbeat_s, self.heartbeat)


# -- routers --------------------------------------------------------------------------------------
class SimRouter:
    """One router: the live router's cores (RoutingCore, WorkerSet, Attempts) on the virtual clock;
    discovery polls the index every ``discovery_s``."""

    def __init__(self, mesh: Mesh, index: int) -> None:
        self.mesh = mesh
        cfg = mesh.cfg
        r = cfg.routing
        pc = replace(r.policy_config, seed=cfg.seed * 1000 + index, clock=lambda: mesh.q.now)
        self.observer = CountingObserver()
        self.core = RoutingCore(make_policy(r.policy, pc), speculative_ttl_s=r.speculative_ttl_s,
                                index_retry_s=r.index_retry_s, clock=lambda: mesh.q.now, observer=self.observer,
                                shared_view=r.shared_view, router_id=f"router-{index}",
                                claim_attempts=r.claim_attempts)
        self.workers = WorkerSet(r.unhealthy_s, clock=lambda: mesh.q.now)
        self.spec = mesh.spec
        self.conflicts = 0
        """Claims refused because another router reserved the worker first."""

    def discover(self) -> None:
        self.workers.update(self.mesh.index.endpoints())
        self.mesh.q.after(self.mesh.cfg.routing.discovery_interval_s, self.discover)

    def route(self, rec: RequestRecord) -> None:
        mesh = self.mesh
        mesh.index.traffic.routed_requests += 1
        chain = mesh.chains[rec.index]
        plan = self.core.plan(self.spec, _Length(rec.prompt_len), self.workers.endpoints, mesh.index, chain=chain,
                              healthy=self.workers.healthy, max_tokens=rec.output_len)
        if not plan.candidates:
            rec.failed = "no worker"
            mesh.request_done(rec)
            return
        delay = mesh.cfg.lookup_latency_s if self.core.wants_index(chain) and plan.query.index_ok else 0.0
        decision = self.core.pick(plan, count=False)
        if plan.versions is None:
            self._decided(rec, plan, decision, delay)
        else:
            # NOTE: the Lookup was answered at once and its latency is spent after the pick: the
            # pick is in flight from now, as live, where it is made when the answer arrives.
            self.core.start(plan, decision.worker_id)
            self.mesh.q.after(delay, self._claim, rec, plan, decision, 0)

    def _claim(self, rec: RequestRecord, plan: RoutePlan, decision: Decision, tries: int) -> None:
        """The shared view: the pick reserved in the index (it lands halfway through the round trip)."""
        claim = self.core.claim(plan, decision, f"r{rec.index}.{rec.attempts + 1}", tries)
        if claim is None:
            self._decided(rec, plan, decision, 0.0)
            return
        half = self.mesh.cfg.reserve_latency_s / 2
        self.mesh.q.after(half, self._reserve, rec, plan, decision, tries, claim)

    def _reserve(self, rec: RequestRecord, plan: RoutePlan, decision: Decision, tries: int, claim: Claim) -> None:
        mesh = self.mesh
        try:
            result = run_now(mesh.index.svc.reserve(Pick(MODEL_ID, claim.worker_id, self.core.router_id,
                                                         claim.request_id, claim.prefill_tokens, claim.blocks,
                                                         claim.seen_version)))
        except NotFound:  # NOTE: the worker left since the Lookup: forwarded, as live, unreserved
            mesh.q.after(mesh.cfg.reserve_latency_s / 2, self._unreserved, rec, plan, decision)
            return
        mesh.index.traffic.reserves += 1
        answer = ClaimAnswer(result.reserved, dict(result.workers))
        mesh.q.after(mesh.cfg.reserve_latency_s / 2, self._claimed, rec, plan, decision, tries, answer)

    def _unreserved(self, rec: RequestRecord, plan: RoutePlan, decision: Decision) -> None:
        self.core.claim_settled(plan)
        self._decided(rec, plan, decision, 0.0)

    def _claimed(self, rec: RequestRecord, plan: RoutePlan, decision: Decision, tries: int,
                 answer: ClaimAnswer) -> None:
        again = self.core.claimed(plan, answer)
        if again is None:
            self._decided(rec, plan, decision, 0.0)
        else:
            self.conflicts += 1
            self._claim(rec, plan, again, tries + 1)

    def _decided(self, rec: RequestRecord, plan: RoutePlan, decision: Decision, delay: float) -> None:
        self.core.commit(plan, decision)
        attempts = Attempts(self.core, plan, decision, self.mesh.cfg.routing.max_attempts,
                            rec.arrival + self.mesh.cfg.routing.request_timeout_s, self.workers.mark_unhealthy)
        self._send(rec, attempts, delay)

    def _send(self, rec: RequestRecord, attempts: Attempts, delay: float) -> None:
        decision = attempts.next(self.mesh.q.now)
        if decision is None:
            rec.failed = f"no worker could take it after {rec.attempts} attempt(s)"
            self.mesh.request_done(rec)
            return
        ticket = self.core.start(attempts.plan, decision.worker_id)
        rec.attempts += 1
        rec.worker = decision.worker_id
        a = _Attempt(rec, self, attempts, ticket, f"r{rec.index}.{rec.attempts}")
        worker = self.mesh.workers_by_id[decision.worker_id]
        self.mesh.q.after(delay + self.mesh.cfg.network_s, worker.submit, a)

    def first_token(self, a: _Attempt) -> None:
        self.core.prefilled(a.ticket)

    def finished(self, a: _Attempt) -> None:
        self.core.finish(a.ticket, a.record.completion_tokens)
        self.mesh.request_done(a.record)

    def refused(self, a: _Attempt, why: str) -> None:
        """INVALID_ARGUMENT from the worker: never retried."""
        self.core.finish(a.ticket)
        a.record.failed = f"refused: {why}"
        self.mesh.request_done(a.record)

    def worker_failed(self, a: _Attempt, worker_id: str) -> None:
        """UNAVAILABLE from the worker: before the first token the next worker, after it a failure."""
        self.core.finish(a.ticket)
        rec = a.record
        if rec.first_token is not None:
            self.workers.mark_unhealthy(worker_id)
            rec.failed = f"worker {worker_id} failed mid-stream"
            self.mesh.request_done(rec)
            return
        if a.attempts.failed(worker_id, Failure.UNAVAILABLE, "the worker is down (simulated)"):
            self._send(rec, a.attempts, 0.0)
        else:
            rec.failed = f"no worker could take it after {rec.attempts} attempt(s)"
            self.mesh.request_done(rec)


class _Length:
    """A prompt the router only measures: the simulator hands it the chain, never the tokens."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


# -- the mesh -------------------------------------------------------------------------------------
def slo_cost(cfg: SimConfig) -> StepTimeModel:
    """The step-time model the SLO's cold prefill is costed on: the fleet's slowest GPU type's (so
    every request can meet the SLO on any worker at no load)."""
    costs = [cfg.cost_for(g) for g in dict.fromkeys(cfg.worker_gpus())]
    return max(costs, key=lambda c: c.step_time([(0, cfg.engine.max_num_batched_tokens)], []))


def cold_prefill_s(cost: StepTimeModel, budget: int, prompt_len: int) -> float:
    """A prompt's prefill alone on an idle worker, chunked as the engine chunks it (``budget`` tokens a step)."""
    t, start = 0.0, 0
    while start < prompt_len:
        n = min(budget, prompt_len - start)
        t += cost.step_time([(start, n)], [])
        start += n
    return t


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
        self.workers = [SimWorker(self, i, gpu) for i, gpu in enumerate(cfg.worker_gpus())]
        self.workers_by_id = {w.worker_id: w for w in self.workers}
        self.routers = [SimRouter(self, i) for i in range(cfg.routers)]
        self.peer_modes = PeerModes(self)
        self.slo_cost = slo_cost(cfg)
        """The step-time model the SLO's cold prefill is costed on: the fleet's slowest."""
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
        n = len(self.workers)
        for i, w in enumerate(self.workers):
            # NOTE: staggered like independent processes; all report once before the first arrival.
            q.at(i * cfg.heartbeat_s / n, w.heartbeat)
        for r in self.routers:
            q.at(0.0, r.discover)
        self.peer_modes.start()
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
        """The request's prefill alone on an idle worker of the fleet's slowest GPU type (:func:`slo_cost`)."""
        return cold_prefill_s(self.slo_cost, self.cfg.engine.max_num_batched_tokens, prompt_len)

    def ttft_limit(self, prompt_len: int) -> float:
        return self.cfg.slo_ttft_s + self.cfg.slo_ttft_prefill_x * self.cold_prefill_s(prompt_len)

    def meets_slo(self, rec: RequestRecord) -> bool:
        if rec.failed or rec.ttft is None:
            return False
        if rec.ttft > self.ttft_limit(rec.prompt_len):
            return False
        tpot = rec.tpot
        return tpot is None or tpot <= self.cfg.slo_tpot_s
