"""A simulated worker: the real engine (scheduler, block pool, prefix cache, events) on the virtual
clock, its forward pass a step-time model, its publisher and heartbeat modelled after the live
ones (kvmesh/kv_client/publisher.py; the batching core is the live one's)."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from kvmesh.contract.block_hash import XXH3_128
from kvmesh.contract.index_protocol import Registration
from kvmesh.contract.types import AllBlocksCleared, BlockStored, KVCacheEvent, Load, SamplingParams
from kvmesh.kv_client.event_batcher import EventBatcher, Message
from kvmesh.kv_service.index import Action
from kvmesh.model_worker.config import EngineConfig
from kvmesh.model_worker.engine.kv_legs import DecodeLeg, KVImport, PrefillLeg
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.scheduling.output import RequestOutput
from kvmesh.model_worker.scheduling.request import Request
from kvmesh.model_worker.simulated.sim_lora import SimLoRA
from kvmesh.replay.records import RequestRecord
from kvmesh.router.core.attempts import Attempts
from kvmesh.router.core.inflight import Ticket
from kvmesh.sim.config import MODEL_ID, PLACEHOLDER_TOKEN, SimConfig
from kvmesh.sim.engine import WindowRunner, WindowScheduler
from kvmesh.sim.events import EventQueue
from kvmesh.sim.index import SimIndex
from kvmesh.sim.workload import Workload


class AttemptOwner(Protocol):
    """The router an attempt came from: what a worker tells it (kvmesh/sim/router.py's SimRouter)."""

    def first_token(self, a: Attempt) -> None: ...

    def finished(self, a: Attempt) -> None: ...

    def refused(self, a: Attempt, why: str) -> None: ...

    def worker_failed(self, a: Attempt, worker_id: str) -> None: ...


class WorkerHost(Protocol):
    """What a worker reads of the mesh it runs in (kvmesh/sim/mesh.py's Mesh)."""

    cfg: SimConfig
    q: EventQueue
    index: SimIndex
    workload: Workload
    chains: list[list[bytes]]
    model_dir: Path
    rng: random.Random
    lost_batches: int
    next_delivery: float
    """When the next arrival can reach a worker at the earliest (a decode window ends there)."""


@dataclass(slots=True)
class Attempt:
    """One request on one worker."""

    record: RequestRecord
    router: AttemptOwner
    attempts: Attempts
    ticket: Ticket
    request_id: str
    kv_import: KVImport | None = None
    """A decode leg's blocks from a prefill worker (kvmesh/sim/pd.py)."""



class SimWorker:
    """A worker: the real engine on the virtual clock, its publisher and heartbeat modelled."""

    def __init__(self, mesh: WorkerHost, index: int, gpu: str) -> None:
        self.mesh = mesh
        self.index = index
        self.gpu = gpu
        """Its GPU type: the step-time model and KV capacity it runs with (nothing it reports names it)."""
        self.worker_id = f"worker-{index:03d}"
        self.role = "both"
        """prefill, decode or both (kvmesh/sim/pd.py sets it for a P/D fleet)."""
        self.address = f"sim:{50061 + index}"
        self.epoch = 0
        self.up = False
        self.engine: LLMEngine | None = None
        self.runner: WindowRunner | None = None
        self.busy_until = 0.0
        self.stepping = False
        self.attempts: dict[str, Attempt] = {}
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
        # NOTE: a workload of LoRA adapters: every worker serves all of them, on disk until a step needs one
        # (a new incarnation starts with empty slots and host cache).
        adapters = self.mesh.workload.adapters
        lora = SimLoRA(adapters, cfg.max_loras, cfg.max_cpu_loras) if adapters else None

        def factory(config, model_config) -> WindowRunner:
            # NOTE: the noise is seeded per worker and incarnation: the same seed, the same steps.
            runner_box.append(WindowRunner(config, model_config, cfg.cost_for(self.gpu), time_scale=0.0,
                                           noise_sigma=cfg.step_time.step_noise,
                                           noise_seed=(cfg.seed * 4099 + self.index) * 131 + self.epoch, lora=lora))
            return runner_box[0]

        e = cfg.engine
        steps = e.num_scheduler_steps if e.num_scheduler_steps > 1 else cfg.window_steps
        self.engine = LLMEngine(EngineConfig(
            model=str(self.mesh.model_dir), model_id=MODEL_ID, block_size=cfg.block_size,
            num_blocks=cfg.blocks_per_worker(self.gpu), max_num_batched_tokens=e.max_num_batched_tokens,
            max_num_seqs=e.max_num_seqs, max_model_len=e.max_model_len, enable_chunked_prefill=e.enable_chunked_prefill,
            hash_algorithm=XXH3_128, num_scheduler_steps=steps, host_kv_blocks=cfg.host_kv_blocks or None,
            # NOTE: the engine's cap on distinct adapters among running requests is its slots; the host cache's
            # size is SimLoRA's (the engine's check wants >= --max-loras; the simulator's 0 means disk only).
            enable_lora=lora is not None, max_loras=cfg.max_loras, max_cpu_loras=max(cfg.max_loras, cfg.max_cpu_loras)),
            runner_factory=factory, scheduler_factory=WindowScheduler)
        self.runner = runner_box[0]
        if lora is not None:
            scheduler = self.engine.scheduler
            self.runner.running_adapters = lambda: {r.lora_name for r in scheduler.running if r.lora_name}
        if e.num_scheduler_steps == 1:
            engine = self.engine
            self.runner.stop_window_on_exit = lambda: engine.scheduler.num_waiting > 0
        self.epoch += 1
        self.up = True
        # NOTE: a new process, a new publisher (kvmesh/kv_client/publisher.py).
        self.batcher = EventBatcher(cfg.event_batch_s, load_reports=cfg.load_on_events)
        kv = self.engine.kv_cache_manager
        self.mesh.index.write("register", Registration(self.worker_id, self.address, MODEL_ID, cfg.block_size,
                                                       XXH3_128, kv.num_blocks, self.epoch,
                                                       host_blocks=kv.num_host_blocks, role=self.role))
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
    def submit(self, a: Attempt, max_tokens: int | None = None, hold_kv_s: float | None = None,
               kv_import: KVImport | None = None) -> None:
        """A request arrives. Prefill/decode disaggregation (kvmesh/sim/pd.py): a prefill leg has ``max_tokens``
        1 and holds its KV ``hold_kv_s``; a decode leg brings the blocks that arrived (``kv_import``)."""
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
                                       SamplingParams(max_tokens=max_tokens or r.output_len, ignore_eos=True),
                                       block_hasher=self.engine.inputs.hasher_for(r.adapter) if r.adapter
                                       else self.engine.block_hasher, block_hashes=self.mesh.chains[r.index],
                                       lora_name=r.adapter or None),
                               PrefillLeg(hold_kv_s) if hold_kv_s is not None else DecodeLeg(kv_import) if kv_import
                               else None)
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
                    if a.kv_import is not None and a.kv_import.taken > 0:
                        rec.pulled_tokens = a.kv_import.taken * self.mesh.cfg.block_size
                    # NOTE: the blocks a decode leg took in were computed for it: no cache hit
                    rec.cached_tokens = max(o.num_cached_tokens, 0) - rec.pulled_tokens
                    q.at(t + hop, a.router.first_token, a)
                elif rec.last_token is not None:
                    rec.max_itl = max(rec.max_itl, (t + hop - rec.last_token) / len(o.new_token_ids))
                rec.last_token = t + hop
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
        index = self.mesh.index
        if msg.snapshot is not None:
            t = self.mesh.index.traffic
            t.snapshots += 1
            t.snapshot_blocks += len(msg.snapshot) + len(msg.host_snapshot)
            index.write("snapshot", self.worker_id, epoch, msg.seq, msg.snapshot, msg.load, msg.host_snapshot)
            if msg.load is not None and msg.load.admitted:
                self.mesh.q.after(self.mesh.cfg.event_delay_s, self._ack_admitted, epoch, msg.load.admitted)
            return
        self._count(msg.events)
        result = index.write("publish", self.worker_id, epoch, msg.seq, msg.events, msg.load)
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
                                         self.load_now() if self.batcher.load_reports else None,
                                         self.engine.host_snapshot())
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
            self.mesh.index.write("heartbeat", self.worker_id, self.epoch, load)
            self.engine.ack_admitted(load.admitted)
        self.mesh.q.after(self.mesh.cfg.heartbeat_s, self.heartbeat)
