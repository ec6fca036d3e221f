"""The engine core of one worker: validation at the door, then schedule -> run -> update per step."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, TypeVar

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.errors import AlreadyExists
from kvmesh.contract.limits import MAX_ADMITTED_IDS, MAX_SNAPSHOT_HOST_BLOCKS, excerpt
from kvmesh.contract.modelinfo import model_id_for
from kvmesh.contract.types import KVCacheEvent, Load, SamplingParams
from kvmesh.model_worker.config import EngineConfig, ModelConfig
from kvmesh.model_worker.engine.input_processor import InputProcessor, load_tokenizer
from kvmesh.model_worker.engine.kv_connector import KVConnector
from kvmesh.model_worker.engine.kv_legs import KVLeg
from kvmesh.model_worker.engine.stats import EngineStats, adapter_requests, adapter_residency
from kvmesh.model_worker.execution.kv_blocks import KVBlocks
from kvmesh.model_worker.execution.model_runner import ModelRunner
from kvmesh.model_worker.scheduling.config import SchedulerConfig
from kvmesh.model_worker.scheduling.kv_cache_manager import KVCacheManager
from kvmesh.model_worker.scheduling.kv_cache_spec import KVCacheConfig
from kvmesh.model_worker.scheduling.kv_holds import KVHolds
from kvmesh.model_worker.scheduling.output import RequestOutput, SchedulerOutput, StepWork
from kvmesh.model_worker.scheduling.request import Request
from kvmesh.model_worker.scheduling.scheduler import Scheduler

__all__ = ["LLMEngine", "load_tokenizer"]

T = TypeVar("T")


class LLMEngine:
    """Continuous-batching engine over one model.

    ``step()`` runs on one thread; ``add_request`` / ``abort_request`` / ``call_on_step_thread`` may be
    called from others: they go through an inbox that ``step()`` drains first. The scheduler, the block
    pool and the P/D holds (``kv_connector``) are touched on the stepping thread only.

    Args:
        config: the engine config; or pass its fields as keyword arguments.
        runner_factory: builds the runner from the checked configs (default ModelRunner); it must
            offer ``num_blocks`` and ``execute(SchedulerOutput)``, as model_worker/simulated/sim_runner.py does.
            A runner without ``execute_window`` runs one decode step per ``step()`` whatever
            ``num_scheduler_steps`` says.
        scheduler_factory: builds the scheduler (default Scheduler) from its config and the KV
            cache manager (the simulator's commits whole windows: kvmesh/sim/engine.py).
    """

    def __init__(self, config: EngineConfig | None = None, *,
                 runner_factory: Callable[[EngineConfig, ModelConfig], Any] | None = None,
                 scheduler_factory: Callable[[SchedulerConfig, KVCacheManager], Scheduler] = Scheduler,
                 **kwargs: Any) -> None:
        config = config if config is not None else EngineConfig(**kwargs)
        self.model_config = ModelConfig.from_dir(config.model)
        config.check(self.model_config)
        self.config = config
        self.model_id = model_id_for(config.model, config.model_id)
        self.tokenizer = load_tokenizer(config.model)
        self.runner = (runner_factory or ModelRunner)(config, self.model_config)
        # NOTE: before the first request (and before a worker reports SERVING): every compile, JIT
        # and graph capture happens here (model_worker/execution/warmup.py).
        warm_up = getattr(self.runner, "warm_up", None)
        self.warmup_report = warm_up() if warm_up is not None else None
        """What the runner's warm-up did and how long it took (None for a runner without one)."""
        self.block_hasher = BlockHasher(self.model_id, config.block_size, config.hash_algorithm)
        self.lora = getattr(self.runner, "lora", None)
        """The runner's LoRA adapters (execution/lora_manager.py); None without --enable-lora."""
        self.inputs = InputProcessor(config, self.model_config, self.block_hasher,
                                     self.lora.has if self.lora is not None else None)
        """Validation at the door (input_processor.py)."""
        # NOTE: the runner decides the grouping (it lays out the KV tensors); a runner without one
        # (the simulated one) gets the grouping the model's windows imply.
        kv_cache_config = getattr(self.runner, "kv_cache_config", None) or KVCacheConfig.from_sliding_windows(
            self.model_config.sliding_windows, config.block_size
        )
        # NOTE: the runner sizes the host tier too (it knows a block's bytes); one without a host
        # tier, or without ``copy_kv_blocks``, gets none.
        num_host_blocks = getattr(self.runner, "num_host_blocks", 0)
        if config.host_tier and not (num_host_blocks and hasattr(self.runner, "copy_kv_blocks")):
            raise ValueError(f"{type(self.runner).__name__} has no host KV tier: drop --host-kv-blocks / "
                             "--kv-offloading-size")
        self.kv_cache_manager = KVCacheManager(
            self.runner.num_blocks,
            config.block_size,
            enable_caching=config.enable_prefix_caching,
            kv_cache_config=kv_cache_config,
            num_host_blocks=num_host_blocks,
        )
        assert config.max_model_len is not None
        self.scheduler = scheduler_factory(
            config.scheduler_config(None if hasattr(self.runner, "execute_window") else 1), self.kv_cache_manager)
        self.async_scheduling = bool(config.async_scheduling) and hasattr(self.runner, "launch")
        """Whether step n+1 is planned and launched before step n's tokens are committed (a runner without
        ``launch``, the simulated one, runs every step to the end)."""
        self._in_flight: tuple[SchedulerOutput, Any] | None = None
        """The launched step whose tokens are not committed yet, with its runner's PendingTokens."""
        self._lock = threading.Lock()
        # NOTE: ("add", Request, its leg) / ("abort", id, None) / ("call", fn, None) in call order; only
        # step() touches the scheduler.
        self._inbox: deque[tuple[str, Any, KVLeg | None]] = deque()
        self._live: set[str] = set()
        # NOTE: ids of requests admitted and not yet in a load report the kv_service acknowledged
        # (report_load / ack_admitted): they retire the routers' picks of them (docs/router.md,
        # "Several routers"). Bounded: past it the oldest go (their picks expire instead).
        self._unreported: dict[str, None] = {}
        self._last_report: tuple[EngineStats, tuple[str, ...], Load] | None = None
        """The last report_load: (stats it was made of, admissions, the load)."""
        self._drained: list[Request] = []
        """Requests moved from the inbox to the scheduler since the last snapshot."""
        # NOTE: cumulative work and time of every step, reported in the load so that routers can
        # learn this worker's step-time coefficients (router/core/policies/cost.py) instead of assuming them.
        self._work = StepWork()
        self._busy_s = 0.0
        self._steps = 0
        # NOTE: the host tier's loads, reported with the counters above so that routers learn what a
        # loaded block costs this worker (router/core/policies/cost.py, HostLinkLearner); the runner
        # times them (``host_load_s``).
        self._host_loaded = 0
        self.last_step_s = 0.0
        """Seconds the last ``step()`` took: the runner's ``last_step_s`` when it models its time
        (the simulated runner), else the wall time of its forward passes."""
        attns = getattr(self.runner, "attention_layers", None)
        self.kv_blocks = (KVBlocks([(a.k_cache, a.v_cache) for a in attns], self.model_id, config.hash_algorithm)
                          if attns else None)
        """The KV cache as blocks of bytes (None for a runner without a KV cache: the simulated one)."""
        self.kv_connector = KVConnector(self.kv_cache_manager.block_pool, self.kv_blocks, config.block_size)
        """Prefill/decode disaggregation's engine side (kv_connector.py): holds and imports, on the step thread."""
        self.warm_request_s = self._warm_step_path() if warm_up is not None else 0.0
        """Seconds the warm-up request took (0: none ran)."""
        self._stats = self._snapshot()

    def _warm_step_path(self) -> float:
        """Runs one request (a prompt of up to 128 tokens, 2 output tokens: a prefill and a decode)
        through ``step()`` before the first client's, then leaves no trace of it: no hashes (no
        prefix-cache entry, no block event), counters at zero, the KV cache zeroed. Returns its time.

        The runner's warm-up runs the model on dummy batches; this reaches the rest of a step, which
        a first request would otherwise pay for: the scheduler, the input packing and its pinned
        host buffers (CUDA), the sampler on a real batch, the async launch and commit."""
        kv, bs = self.kv_cache_manager, self.config.block_size
        assert self.config.max_model_len is not None
        n = min(128, self.config.max_model_len - 2, self.config.max_num_batched_tokens, (kv.num_blocks - 1) * bs - 2)
        if n < 1:
            return 0.0
        start = time.perf_counter()
        vocab = self.model_config.vocab_size
        self.scheduler.add_request(Request("__warm-up-request__", [1 + i % (vocab - 1) for i in range(n)],
                                           SamplingParams(max_tokens=2, ignore_eos=True)))
        while self.scheduler.has_unfinished_requests() or self._in_flight is not None:
            self.step()
        self.kv_cache_manager.take_events()
        self._work, self._busy_s, self._steps, self.last_step_s = StepWork(), 0.0, 0, 0.0
        kv.prefix_cache_queries = kv.prefix_cache_hits = kv.host_cache_hits = 0
        for layer in getattr(self.runner, "attention_layers", ()):
            layer.k_cache.zero_()
            layer.v_cache.zero_()
        return time.perf_counter() - start

    @property
    def kv_holds(self) -> KVHolds:
        """The connector's holds and imports (step thread only; the simulator reads them on its one thread)."""
        return self.kv_connector.holds

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    cache_salt: str = "", leg: KVLeg | None = None, lora_name: str | None = None) -> None:
        """Queues a request; it starts at the next ``step()``.

        ``leg``: a prefill leg (its prompt's full blocks are held for a decode worker when it ends) or a
        decode leg (its blocks are taken into the pool first): kv_legs.py. ``lora_name``: the LoRA adapter
        to run it under (a loaded one; None = the base model).

        Raises:
            ValueError: the request is malformed or can never fit; nothing else is affected.
        """
        request = self.inputs.make_request(request_id, prompt_token_ids, sampling_params, cache_salt, lora_name)
        self.submit(request, leg)

    def load_adapter(self, name: str, path: str) -> None:
        """Loads the LoRA adapter of the PEFT directory ``path`` as ``name`` (vLLM's /v1/load_lora_adapter);
        requests may name it at once. Safe from any thread.

        Raises:
            ValueError: LoRA is off, the name is taken, or the adapter cannot serve this model (what is wrong).
        """
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters (start it with --enable-lora)")
        self.lora.load_adapter(name, path)

    def unload_adapter(self, name: str) -> None:
        """Unloads LoRA adapter ``name`` (vLLM's /v1/unload_lora_adapter). Safe from any thread.

        Raises:
            ValueError: LoRA is off, no such adapter is loaded, or a live request runs under it.
        """
        if self.lora is None:
            raise ValueError("this engine serves no LoRA adapters (start it with --enable-lora)")
        with self._lock:
            queued = [item for kind, item, _ in self._inbox if kind == "add"]
        users = [r.request_id for r in [*queued, *list(self.scheduler.requests.values())] if r.lora_name == name]
        if users:
            raise ValueError(f"LoRA adapter {excerpt(name)} is in use by {len(users)} live requests "
                             f"(e.g. {excerpt(users[0])}); unload it when they are done")
        self.lora.unload_adapter(name)

    def check_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        """Raises ValueError as :meth:`add_request` would for this prompt and these parameters, adding
        nothing (a decode leg is checked before its KV moves)."""
        self.inputs.check_request(prompt_token_ids, sampling_params)

    def submit(self, request: Request, leg: KVLeg | None = None) -> None:
        """Queues a request the caller built (:meth:`add_request` builds them from a prompt; the
        simulator builds its own, with its workload's block hashes). Checks what every request must
        meet: a non-empty prompt that leaves room for its ``max_tokens`` in ``max_model_len``.
        ``leg``: a P/D leg's options (engine/kv_legs.py).

        Raises:
            ValueError: it can never fit. AlreadyExists: its id is live.
        """
        self.inputs.check_fits(request)
        with self._lock:
            if request.request_id in self._live:
                raise AlreadyExists(f"request id {excerpt(request.request_id)} is already in use")
            self._live.add(request.request_id)
            self._inbox.append(("add", request, leg))
            self._unreported[request.request_id] = None
            if len(self._unreported) > MAX_ADMITTED_IDS:
                del self._unreported[next(iter(self._unreported))]

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raises ValueError naming the problem: empty, too long for max_model_len, or an id outside the vocabulary."""
        self.inputs.check_prompt(prompt_token_ids)

    def num_cached_tokens(self, request_id: str) -> int:
        """Prompt tokens of a live request the prefix cache served at its admission; 0 before it
        was admitted or once it is gone. Safe from any thread (one dict read)."""
        request = self.scheduler.requests.get(request_id)
        return max(request.num_cached_tokens, 0) if request is not None else 0

    def abort_request(self, request_id: str) -> bool:
        """Aborts a queued or running request at the next step; False when it is not live."""
        with self._lock:
            if request_id not in self._live:
                return False
            self._live.discard(request_id)
            self._inbox.append(("abort", request_id, None))
            return True

    def _drain_inbox(self) -> None:
        while True:
            with self._lock:
                if not self._inbox:
                    return
                kind, item, leg = self._inbox.popleft()
                if kind == "add":
                    # NOTE: in the scheduler but not in the last snapshot: stats() counts it until the next.
                    self._drained.append(item)
            if kind == "add":
                if leg is not None:
                    # NOTE: in the same inbox item as the add: no step admits the request before its blocks are in.
                    self.kv_connector.add(item, leg)
                self.scheduler.add_request(item)
            elif kind == "call":
                item(self)
            else:
                self.kv_connector.aborted(item)
                self.scheduler.abort_request(item)

    def call_on_step_thread(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Runs ``fn(engine)`` on the step thread before the next step's schedule (in call order with
        adds and aborts); its result or exception comes back in the future. What another thread wants of
        the pool or the P/D holds goes through here (model_worker/serving/kv_transfer.py)."""
        future: Future[T] = Future()

        def call(engine: LLMEngine) -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(engine))
            except BaseException as exc:  # noqa: BLE001 - the caller's to handle, never the step's
                future.set_exception(exc)

        with self._lock:
            self._inbox.append(("call", call, None))
        return future

    def has_unfinished_requests(self) -> bool:
        return bool(self._inbox) or self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self, on_output: Callable[[list[RequestOutput]], None] | None = None) -> list[RequestOutput]:
        """Schedules one batch, runs it, and returns the requests that got tokens or finished.

        A multi-step window (all-decode batch, ``num_scheduler_steps > 1``) runs several forward
        passes; a request then appears once per inner step in the result. ``on_output`` gets each
        inner step's outputs as soon as its tokens are on the host, so a caller can stream every
        token when it is produced instead of when the window ends.

        With async scheduling a call launches its batch and then commits the batch the call before
        launched (so its outputs are that batch's): the host plans and launches step n+1 while the
        device still runs step n (docs/engine.md, "Async scheduling").
        """
        self._drain_inbox()
        prev, self._in_flight = self._in_flight, None
        out = self.scheduler.schedule()
        kvc = self.kv_connector
        if kvc.holds.imports or kvc.holds.holds:
            kvc.scheduled(self.scheduler.requests, time.monotonic())
        outputs: list[RequestOutput] = []

        def commit(step_outputs: list[RequestOutput]) -> None:
            if kvc.has_prefill_legs:
                kvc.finished(step_outputs, time.monotonic())
            outputs.extend(step_outputs)
            finished = [o.request_id for o in step_outputs if o.finished]
            if finished:
                with self._lock:
                    self._live.difference_update(finished)
            if on_output is not None and step_outputs:
                on_output(step_outputs)

        runner = self.runner
        t0 = time.perf_counter()
        if out.kv_transfers is not None:
            # NOTE: before the forward pass, which overwrites the evicted blocks and reads the loaded ones
            # (and, on the device's stream, after the step in flight).
            runner.copy_kv_blocks(out.kv_transfers)
            self._host_loaded += len(out.kv_transfers.loads)
        if out.num_steps > 1:
            if prev is not None:
                # NOTE: a window's inputs are known tokens: the step in flight is committed first.
                commit(self.scheduler.update_from_output(prev[0], prev[1].wait()))
            self._run_window(out, commit)
        elif self.async_scheduling:
            if not out.is_empty:
                self.scheduler.start_step(out)
            pending = runner.launch(out)
            if not out.is_empty:
                self._in_flight = (out, pending)
                self._work.add(out.work())
                self._steps += 1
            if prev is not None:
                # NOTE: the step before, committed while this one runs: stop checks and streaming
                # happen behind the launch (its tokens' copy overlapped it).
                commit(self.scheduler.update_from_output(prev[0], prev[1].wait()))
        else:
            commit(self.scheduler.update_from_output(out, runner.execute(out)))
            if not out.is_empty:
                self._work.add(out.work())
                self._steps += 1
        modelled = getattr(runner, "last_step_s", None)
        self.last_step_s = modelled if modelled is not None else time.perf_counter() - t0
        self._busy_s += self.last_step_s
        snap = self._snapshot()
        with self._lock:
            self._stats = snap
            self._drained.clear()
        return outputs

    def _run_window(self, out: SchedulerOutput, commit: Callable[[list[RequestOutput]], None]) -> None:
        """Runs a multi-step window, committing each inner step's tokens as they reach the host."""
        num_done = 0
        # NOTE: per row, the context its next token attends to; a runner hands over one token per
        # row per inner step (the GPU's) or several at once (the simulator's whole windows).
        context = {s.request.request_id: s.start + 1 for s in out.scheduled}
        work = self._work

        def on_step(tokens: dict[str, list[int]]) -> list[str]:
            nonlocal num_done
            steps = 0
            for rid, ts in tokens.items():
                m, c = len(ts), context[rid]
                work.decode_seqs += m
                work.decode_context_tokens += m * c + m * (m - 1) // 2
                context[rid] = c + m
                steps = max(steps, m)
            num_done += steps
            commit(self.scheduler.update_from_output(out, tokens))
            # NOTE: aborts take effect between inner steps; adds only queue until the next schedule().
            self._drain_inbox()
            return self.scheduler.prepare_window_step(out) if num_done < out.num_steps else []

        self.runner.execute_window(out, on_step)
        self._steps += num_done

    def take_kv_events(self) -> list[KVCacheEvent]:
        """Block lifecycle events since the last call (to publish to kv_service)."""
        return self.kv_cache_manager.take_events()

    def cached_block_hashes(self) -> set[bytes]:
        """Every block hash this worker holds on the device: a kv_service resync's snapshot of that tier."""
        return self.kv_cache_manager.cached_block_hashes()

    def host_snapshot(self) -> list[bytes]:
        """The host tier's hashes for a resync's snapshot, in the order they were stored, the most recent
        ``MAX_SNAPSHOT_HOST_BLOCKS`` of a larger tier (docs/kv-service.md, Tiers)."""
        pool = self.kv_cache_manager.host_pool
        if pool is None:
            return []
        hashes = list(pool.cached)
        return hashes[-MAX_SNAPSHOT_HOST_BLOCKS:]

    def host_block_hashes(self) -> set[bytes]:
        """Every block hash the host tier holds (empty without one)."""
        return self.kv_cache_manager.host_block_hashes()

    def queued_requests(self) -> list[Request]:
        """Requests submitted since the last step's snapshot and not in it (in the inbox, or taken into the
        running step); safe from any thread."""
        with self._lock:
            return [item for kind, item, _ in self._inbox if kind == "add"] + self._drained

    def stats(self) -> EngineStats:
        """The load as of the last step, plus requests queued since; safe from any thread. Read it,
        never change it: with nothing queued it is the step's own snapshot."""
        with self._lock:
            queued = [item for kind, item, _ in self._inbox if kind == "add"] + self._drained
            snap = self._stats
        if self.lora is not None:
            requests = dict(snap.adapter_requests)
            for r in queued:
                if r.lora_name:
                    requests[r.lora_name] = requests.get(r.lora_name, 0) + 1
            adapters = adapter_residency(self.lora, requests)
            if adapters != snap.adapters:
                snap = replace(snap, adapters=adapters, max_loras=self.lora.max_loras)
        if not queued:
            return snap
        return replace(
            snap,
            num_waiting=snap.num_waiting + len(queued),
            queued_prefill_tokens=snap.queued_prefill_tokens + sum(r.num_tokens for r in queued),
        )

    def report_load(self, stats: EngineStats | None = None) -> Load:
        """The load to report to the kv_service: :meth:`stats`' load (or ``stats``', taken after
        this call's admissions), listing the requests admitted since the last acknowledged report:
        every one of them is in its counts."""
        with self._lock:
            admitted = tuple(self._unreported)
        # NOTE: listed first, counted after: every request listed is in the counts.
        stats = stats or self.stats()
        # NOTE: an idle worker is asked for the same report over and over (heartbeats, and llm-d's
        # load scrapes every 50 ms in the simulator): the last one is kept while nothing changed.
        last = self._last_report
        if last is not None and last[0] is stats and last[1] == admitted:
            return last[2]
        load = stats.report(admitted, reports_admissions=True)
        self._last_report = (stats, admitted, load)
        return load

    def ack_admitted(self, request_ids: Iterable[str]) -> None:
        """The kv_service applied a report listing these admissions: later reports leave them out."""
        with self._lock:
            for rid in request_ids:
                self._unreported.pop(rid, None)

    @property
    def last_step_stats(self) -> EngineStats:
        """The load as of the end of the last step, without requests queued since."""
        return self._stats

    def _snapshot(self) -> EngineStats:
        # NOTE: taken on the step thread only: the scheduler's queues are not thread-safe.
        kv = self.kv_cache_manager
        snap = EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            queued_prefill_tokens=self.scheduler.queued_prefill_tokens,
            prefilling_tokens=self.scheduler.prefilling_tokens,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            host_cache_hits=kv.host_cache_hits,
            num_host_blocks=kv.host_pool.num_blocks if kv.host_pool is not None else 0,
            num_host_cached_blocks=len(kv.host_pool) if kv.host_pool is not None else 0,
            busy_s=self._busy_s,
            steps=self._steps,
            work=replace(self._work),
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            host_loaded_blocks=self._host_loaded,
            host_load_s=getattr(self.runner, "host_load_s", 0.0),
            num_cached_blocks=len(kv.block_pool.cached_block_hash_to_block),
        )
        if self.lora is not None:
            snap.adapter_requests = adapter_requests(self.scheduler.requests.values())
            snap.adapters, snap.max_loras = adapter_residency(self.lora, snap.adapter_requests), self.lora.max_loras
            lora = self.lora
            snap.adapter_loads = (lora.cpu_loads, lora.cpu_load_s, lora.disk_loads, lora.disk_load_s)
        return snap
