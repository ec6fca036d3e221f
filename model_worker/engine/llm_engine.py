"""The engine core of one worker: validation at the door, then schedule -> run -> update per step."""

from __future__ import annotations

import copy
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.errors import AlreadyExists
from kvmesh.contract.limits import MAX_ADMITTED_IDS, MAX_SNAPSHOT_HOST_BLOCKS, excerpt
from kvmesh.contract.modelinfo import model_id_for
from kvmesh.contract.types import DEFAULT_MAX_TOKENS, KVCacheEvent, Load, SamplingParams
from kvmesh.model_worker.config import EngineConfig, ModelConfig
from kvmesh.model_worker.execution.kv_blocks import KVBlocks
from kvmesh.model_worker.execution.model_runner import ModelRunner
from kvmesh.model_worker.scheduling.config import SchedulerConfig
from kvmesh.model_worker.scheduling.kv_cache_manager import KVCacheManager
from kvmesh.model_worker.scheduling.kv_cache_spec import KVCacheConfig
from kvmesh.model_worker.scheduling.kv_holds import KVHolds
from kvmesh.model_worker.scheduling.output import RequestOutput, SchedulerOutput, StepWork
from kvmesh.model_worker.scheduling.request import Request, RequestStatus
from kvmesh.model_worker.scheduling.scheduler import Scheduler


@dataclass(slots=True)
class EngineStats:
    """A worker's load as it reports it (heartbeats, routing)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    queued_prefill_tokens: int
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache so far."""
    prefix_cache_hits: int
    """Of those, tokens found cached (on the device or in the host tier)."""
    host_cache_hits: int = 0
    """Of those, tokens found in the host tier and loaded back."""
    num_host_blocks: int = 0
    """Blocks of the host KV tier (0: none)."""
    num_host_cached_blocks: int = 0
    """Of those, blocks holding a hash."""
    busy_s: float = 0.0
    """Seconds spent in steps since start (modelled seconds on a simulated worker)."""
    steps: int = 0
    """Forward passes since start (every inner step of a multi-step window counts)."""
    work: StepWork = field(default_factory=StepWork)
    """Work of those passes since start: what ``busy_s`` was spent on."""
    max_num_batched_tokens: int = 0
    host_loaded_blocks: int = 0
    """Blocks loaded back from the host tier since start."""
    host_load_s: float = 0.0
    """Seconds those loads took (part of ``busy_s``; modelled seconds on a simulated worker)."""
    num_cached_blocks: int = 0
    """Device blocks holding a cached prefix (in use or idle)."""

    @property
    def load(self) -> Load:
        return self.report()

    def report(self, admitted: tuple[str, ...] = (), reports_admissions: bool = False) -> Load:
        """The load, with the admissions it covers (what a kvmesh worker reports)."""
        w = self.work
        return Load(self.num_running, self.num_waiting, self.num_free_blocks, self.num_total_blocks,
                    self.queued_prefill_tokens, self.busy_s, self.steps, w.prefill_tokens, w.prefill_pairs,
                    w.decode_seqs, w.decode_context_tokens, self.max_num_batched_tokens, admitted,
                    reports_admissions, host_loaded_blocks=self.host_loaded_blocks, host_load_s=self.host_load_s,
                    num_cached_blocks=self.num_cached_blocks)


@dataclass(slots=True)
class KVImport:
    """KV blocks that arrived from a prefill worker for one request (prefill/decode disaggregation):
    taken into the pool on the step thread right before the request joins the scheduler."""

    block_hashes: list[bytes]
    """The prompt's full blocks as the prefill worker held them, from the root."""
    start: int
    """``blocks[0]`` is ``block_hashes[start]``'s."""
    blocks: Any
    """A tensor ``[n, *KVBlocks.block_shape]`` in wire layout; None on a simulated worker (no bytes)."""
    num_blocks: int = -1
    """Blocks that arrived when ``blocks`` is None (the simulator's transfers)."""
    taken: int = -1
    """Set on the step thread: blocks the pool took in (-1 until then)."""


def load_tokenizer(model_dir: str | Path) -> Any | None:
    """The model's ``tokenizers.Tokenizer`` from tokenizer.json, or None when there is none."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def _eos_token_ids(model_dir: str | Path, model_config: ModelConfig) -> list[int]:
    ids = list(model_config.eos_token_ids)
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        for e in [eos] if isinstance(eos, int) else (eos or []):
            if e not in ids:
                ids.append(e)
    return ids


class LLMEngine:
    """Continuous-batching engine over one model.

    ``step()`` runs on one thread; ``add_request`` / ``abort_request`` may be called from
    others: they go through an inbox that ``step()`` drains first.

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
        self.eos_token_ids = _eos_token_ids(config.model, self.model_config)
        self.runner = (runner_factory or ModelRunner)(config, self.model_config)
        # NOTE: before the first request (and before a worker reports SERVING): every compile, JIT
        # and graph capture happens here (model_worker/execution/warmup.py).
        warm_up = getattr(self.runner, "warm_up", None)
        self.warmup_report = warm_up() if warm_up is not None else None
        """What the runner's warm-up did and how long it took (None for a runner without one)."""
        self.block_hasher = BlockHasher(self.model_id, config.block_size, config.hash_algorithm)
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
        # NOTE: ("add", Request) / ("abort", id) in call order; only step() touches the scheduler.
        self._inbox: deque[tuple[str, Any]] = deque()
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
        # NOTE: prefill/decode disaggregation (model_worker/scheduling/kv_holds.py): the blocks held
        # for decode workers, the blocks taken in from prefill workers; both on the step thread.
        self.kv_holds = KVHolds(self.kv_cache_manager.block_pool)
        attns = getattr(self.runner, "attention_layers", None)
        self.kv_blocks = (KVBlocks([(a.k_cache, a.v_cache) for a in attns], self.model_id, config.hash_algorithm)
                          if attns else None)
        """The KV cache as blocks of bytes (None for a runner without a KV cache: the simulated one)."""
        self._hold_on_finish: dict[str, tuple[Request, float]] = {}
        self._imports: dict[str, KVImport] = {}
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

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams | None = None,
                    cache_salt: str = "", hold_kv_s: float | None = None, kv_import: KVImport | None = None) -> None:
        """Queues a request; it starts at the next ``step()``.

        ``hold_kv_s``: a prefill leg: when it ends, its prompt's full blocks are held for a decode
        worker this many seconds at most (:meth:`release_kv` ends it sooner). ``kv_import``: a decode
        leg: these blocks are taken into the pool first.

        Raises:
            ValueError: the request is malformed or can never fit; nothing else is affected.
        """
        # NOTE: a copy the caller cannot change under us (its only mutable field is the stop list).
        params = (replace(sampling_params, stop_token_ids=copy.copy(sampling_params.stop_token_ids))
                  if sampling_params is not None else SamplingParams())
        params.validate()
        self.check_prompt(prompt_token_ids)
        if params.max_tokens is None:
            params.max_tokens = min(DEFAULT_MAX_TOKENS, self.config.max_model_len - len(prompt_token_ids))
        extra_eos = self.eos_token_ids[1:]
        if extra_eos and not params.ignore_eos:
            params = replace(params, stop_token_ids=[*params.stop_token_ids, *extra_eos])
        request = Request(
            request_id,
            prompt_token_ids,
            params,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            block_hasher=self.block_hasher if self.config.enable_prefix_caching else None,
            cache_salt=cache_salt,
        )
        self.submit(request, hold_kv_s=hold_kv_s, kv_import=kv_import)

    def check_request(self, prompt_token_ids: list[int], sampling_params: SamplingParams) -> None:
        """Raises ValueError as :meth:`add_request` would for this prompt and these parameters, adding
        nothing (a decode leg is checked before its KV moves)."""
        sampling_params.validate()
        self.check_prompt(prompt_token_ids)
        room = self.config.max_model_len - len(prompt_token_ids)
        if sampling_params.max_tokens is not None and sampling_params.max_tokens > room:
            raise ValueError(f"max_tokens is {sampling_params.max_tokens}, but the prompt's {len(prompt_token_ids)} "
                             f"tokens leave room for {room} of max_model_len {self.config.max_model_len}; ask for at "
                             f"most {room}")

    def submit(self, request: Request, hold_kv_s: float | None = None, kv_import: KVImport | None = None) -> None:
        """Queues a request the caller built (:meth:`add_request` builds them from a prompt; the
        simulator builds its own, with its workload's block hashes). Checks what every request must
        meet: a non-empty prompt that leaves room for its ``max_tokens`` in ``max_model_len``.

        Raises:
            ValueError: it can never fit. AlreadyExists: its id is live.
        """
        n, max_len = request.num_prompt_tokens, self.config.max_model_len
        assert max_len is not None
        self.check_prompt_length(n)
        room = max_len - n
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None and max_tokens > room:
            raise ValueError(
                f"max_tokens is {max_tokens}, but the prompt's {n} tokens leave room for "
                f"{room} of max_model_len {max_len}; ask for at most {room}")
        with self._lock:
            if request.request_id in self._live:
                raise AlreadyExists(f"request id {excerpt(request.request_id)} is already in use")
            self._live.add(request.request_id)
            if hold_kv_s is not None:
                self._hold_on_finish[request.request_id] = (request, hold_kv_s)
            if kv_import is not None:
                self._imports[request.request_id] = kv_import
            self._inbox.append(("add", request))
            self._unreported[request.request_id] = None
            if len(self._unreported) > MAX_ADMITTED_IDS:
                del self._unreported[next(iter(self._unreported))]

    def check_prompt_length(self, n: int) -> None:
        """Raises ValueError unless a prompt of ``n`` tokens fits (and leaves room for one token)."""
        if n == 0:
            raise ValueError("the prompt is empty; it needs at least one token")
        max_len = self.config.max_model_len
        assert max_len is not None
        if n >= max_len:
            raise ValueError(
                f"the prompt has {n} tokens but max_model_len is {max_len}; shorten it to at most "
                f"{max_len - 1} tokens to leave room for one generated token"
            )

    def check_prompt(self, prompt_token_ids: list[int]) -> None:
        """Raises ValueError naming the problem: empty, too long for max_model_len, or an id outside the vocabulary."""
        self.check_prompt_length(len(prompt_token_ids))
        vocab = self.model_config.vocab_size
        for i, t in enumerate(prompt_token_ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                raise ValueError(f"prompt token {i} is {t!r}, outside the vocabulary [0, {vocab})")

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
            self._inbox.append(("abort", request_id))
            return True

    def _drain_inbox(self) -> None:
        while True:
            with self._lock:
                if not self._inbox:
                    return
                kind, item = self._inbox.popleft()
                if kind == "add":
                    # NOTE: in the scheduler but not in the last snapshot: stats() counts it until the next.
                    self._drained.append(item)
            if kind == "add":
                kv_import = self._imports.pop(item.request_id, None)
                if kv_import is not None:
                    self._take_in(item.request_id, kv_import)
                self.scheduler.add_request(item)
            elif kind == "call":
                item(self)
            else:
                self._hold_on_finish.pop(item, None)
                self.scheduler.abort_request(item)

    def _take_in(self, request_id: str, kv: KVImport) -> None:
        """A decode leg's arrived blocks into the pool (kv_holds.py), on the step thread."""
        n = len(kv.blocks) if kv.blocks is not None else kv.num_blocks
        first, ids = self.kv_holds.take_in(request_id, kv.block_hashes[:kv.start + n], kv.start)
        if ids and kv.blocks is not None:
            assert self.kv_blocks is not None, "KV blocks arrived at a runner without a KV cache"
            self.kv_blocks.write(ids, kv.blocks[first - kv.start:first - kv.start + len(ids)])
        kv.taken = len(ids)

    def call_on_step_thread(self, fn: Callable[[LLMEngine], None]) -> None:
        """Runs ``fn(engine)`` on the step thread before the next step's schedule (in call order with
        adds and aborts): what touches the pool from another thread goes through here."""
        with self._lock:
            self._inbox.append(("call", fn))

    def release_kv(self, request_id: str) -> None:
        """Ends a prefill leg's hold (kv_holds.py) at the next step; a no-op when there is none."""
        self.call_on_step_thread(lambda e: e.kv_holds.release(request_id))

    def _hold_finished(self, step_outputs: list[RequestOutput]) -> None:
        """Prefill legs that just ended hold their prompt's full blocks (still cached: freed this step,
        nothing allocated since) for a decode worker."""
        now = time.monotonic()
        bs = self.config.block_size
        for o in step_outputs:
            if not o.finished:
                continue
            held = self._hold_on_finish.pop(o.request_id, None)
            if held is None or o.finish_reason == "abort":
                continue
            request, ttl = held
            # NOTE: the decode worker recomputes the prompt's last token (every engine does), so the
            # blocks it can use are those before it.
            self.kv_holds.hold(o.request_id, request.block_hashes[:(request.num_prompt_tokens - 1) // bs], now + ttl)

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
        if self.kv_holds.imports:
            requests = self.scheduler.requests
            for rid in list(self.kv_holds.imports):
                r = requests.get(rid)
                if r is None or r.status != RequestStatus.WAITING:
                    self.kv_holds.admitted(rid)
        if self.kv_holds.holds:
            self.kv_holds.expire(time.monotonic())
        outputs: list[RequestOutput] = []

        def commit(step_outputs: list[RequestOutput]) -> None:
            if self._hold_on_finish:
                self._hold_finished(step_outputs)
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
            return [item for kind, item in self._inbox if kind == "add"] + self._drained

    def stats(self) -> EngineStats:
        """The load as of the last step, plus requests queued since; safe from any thread. Read it,
        never change it: with nothing queued it is the step's own snapshot."""
        with self._lock:
            queued = [item for kind, item in self._inbox if kind == "add"] + self._drained
            snap = self._stats
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
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            queued_prefill_tokens=self.scheduler.queued_prefill_tokens,
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
