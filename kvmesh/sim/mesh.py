"""The mesh in virtual time: one process, one event queue, no threads, sockets or sleeps.

What runs is the production code; only the forward pass and the wire are modelled. This module
wires the parts; each lives in its own file:

- **workers** (kvmesh/sim/worker.py): each one a real :class:`LLMEngine` (scheduler, block pool, prefix cache, chunked
  prefill, multi-step windows, block events) whose runner is the simulated one
  (model_worker/simulated/sim_runner.py) with ``time_scale=0``: a step *returns* its modelled duration
  and the worker is busy that long on the virtual clock. Its kv publisher and heartbeat are
  modelled after kvmesh/kv_client/publisher.py: block events are merged into one message at most
  every ``event_batch_s``, numbered per epoch, delivered ``event_delay_s`` later; a RESYNC answer
  makes the worker send a snapshot of its cached blocks as its next message; every message
  carries the engine's load as it is sent, and a load that changed without events goes out alone
  in the next message slot (``load_on_events``, the live publisher's behaviour); a heartbeat
  every ``heartbeat_s`` carries it too (with ``load_on_events=False`` the only load report: what
  the router sees of load is then that stale).
- **index** (kvmesh/sim/index.py): the kv_service core, :class:`KVService` over the in-memory store (its coroutines
  never suspend there, so ``run_now`` drives them without an event loop; the same
  semantics as the Redis store: refcounts, per-worker LRU caps, leases, epochs, Lookup), on the
  virtual clock.
- **routers** (kvmesh/sim/router.py): :class:`RoutingCore` (router/core/routing.py) with the registered policy classes: the same
  planning code as the live router (chain, breaker, candidates from one Lookup + speculative map
  + in-flight view, hot-spot guard, fallback, in-flight accounting). Discovery polls the index
  every ``discovery_s``; a Lookup takes ``lookup_latency_s`` and fails past ``lookup_timeout_s``;
  the first token and the end of a stream reach the router ``network_s`` after the worker sends
  them. A worker that is down answers UNAVAILABLE: the router marks it unhealthy and retries the
  next pick, as router/model_router.py does. Peers with a multi-router mode of their own run in it
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
from collections.abc import Callable
from pathlib import Path

from kvmesh.contract.block_hash import XXH3_128
from kvmesh.contract.types import ModelSpec
from kvmesh.replay.records import RequestRecord
from kvmesh.sim.config import MODEL_ID, SimConfig, cold_prefill_s, slo_cost
from kvmesh.sim.events import EventQueue
from kvmesh.sim.goodput import objectives_for
from kvmesh.sim.index import SimIndex
from kvmesh.sim.pd import PDSimRouter, PDStats, worker_roles
from kvmesh.sim.replicas import PeerModes
from kvmesh.sim.router import SimRouter
from kvmesh.sim.worker import SimWorker
from kvmesh.sim.workload import Workload


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
        self.spec = ModelSpec(MODEL_ID, cfg.block_size, XXH3_128)
        self.index = SimIndex(self.q, cfg)
        self.workers = [SimWorker(self, i, gpu) for i, gpu in enumerate(cfg.worker_gpus())]
        for w, role in zip(self.workers, worker_roles(cfg.pd, cfg.pd_split, len(self.workers)), strict=True):
            w.role = role
        self.workers_by_id = {w.worker_id: w for w in self.workers}
        self.pd_stats = PDStats()
        self.routers = [PDSimRouter(self, i, cfg.pd_split) if cfg.pd and cfg.pd_split else SimRouter(self, i)
                        for i in range(cfg.routers)]
        self.peer_modes = PeerModes(self.q, cfg, self.routers, self.workers)
        self.slo_cost = slo_cost(cfg)
        """The step-time model the SLO's cold prefill is costed on: the fleet's slowest."""
        self.objectives = objectives_for(cfg.objectives, [r.prompt_len for r in workload.requests],
                                         self.cold_prefill_s)
        """What every request carries to its router (none without --objectives)."""
        self.records: list[RequestRecord] = []
        self.lost_batches = 0
        self.done = 0
        self.slo_missed = 0
        self.stopped_early = False
        self._progress = progress
        self._arrivals = [r.arrival_s / cfg.rate for r in workload.requests]
        self._next = 0
        self._arrival_delivery = 0.0
        self._forwards: list[float] = []
        """When each request being routed or on its way to a worker reaches one at the earliest (a heap)."""

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
            self._arrival_delivery = t + self.cfg.lookup_latency_s + self.cfg.network_s
        else:
            self._arrival_delivery = float("inf")

    @property
    def next_delivery(self) -> float:
        """When a request reaches a worker next, at the earliest (a decode window ends there): the next
        arrival's Lookup and hop, or a request already on its way (its Reserve round trips, a retry).

        NOTE: without the requests on their way, a request delayed by its Reserve round trips reached a
        worker whose window had been cut at the estimate of the next arrival, and waited for the
        whole next window (up to --window-steps steps), where one-step scheduling admits it at the
        next step: a single router's TTFT p50 on the conversation trace went 0.55 -> 1.00 s with a
        10 ms --reserve-latency."""
        f = self._forwards
        while f and f[0] < self.q.now:
            heapq.heappop(f)
        return min(self._arrival_delivery, f[0]) if f else self._arrival_delivery

    def expect(self, dt: float) -> None:
        """A request being routed may reach a worker ``dt`` from now at the earliest (its Reserve's answer
        and the hop): a decode window that starts before then ends there."""
        heapq.heappush(self._forwards, self.q.now + dt)

    def forward(self, dt: float, submit: Callable, *args) -> None:
        """A request leaves a router for a worker; ``submit(*args)`` runs when it arrives, ``dt`` from now."""
        self.expect(dt)
        self.q.after(dt, submit, *args)

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
        if self.cfg.slo_itl_s and rec.max_itl > self.cfg.slo_itl_s:
            return False
        return tpot is None or tpot <= self.cfg.slo_tpot_s
