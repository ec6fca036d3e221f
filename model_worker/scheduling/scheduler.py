"""Continuous batching with chunked prefill, prefix-cache admission and preemption by recompute.

Each step: ``schedule()`` picks the batch under the token budget, the model runs it, and
``update_from_output()`` records the sampled tokens and retires finished requests.

Multi-step decode: when every scheduled request decodes and no waiting request could be admitted,
``schedule()`` gives each request slots for up to ``num_scheduler_steps`` tokens and marks the
batch with ``num_steps > 1``; the runner then runs that many forward passes without coming back
here. After each inner step ``update_from_output()`` commits that step's tokens (stop rules apply
per token, so a request can finish mid-window) and ``prepare_window_step()`` readies the next one.
(The virtual-time simulator commits a whole window at once with its own scheduler, kvmesh/sim/engine.py,
under the same stop rule: ``stop_after()``.)

Async scheduling (vLLM's async scheduling, SGLang's overlap scheduler): the engine launches a step,
calls ``start_step()`` on its output, and runs the next ``schedule()`` before that step's
``update_from_output()``. ``start_step()`` counts the step's tokens as computed at once and each
token it samples as a placeholder (``Request.num_output_placeholders``): the next schedule gives
such a request its next position, whose input id the runner takes from the previous step's
sampled ids on the device. A request whose in-flight token is its last by length is not scheduled
again; one that stops on a token (EOS, a stop id) runs one step more, whose token is dropped.
Blocks are cached when their tokens are known (one step later than without it).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kvmesh.model_worker.scheduling.config import SchedulerConfig
from kvmesh.model_worker.scheduling.kv_cache_manager import KVCacheManager
from kvmesh.model_worker.scheduling.output import RequestOutput, ScheduledRequest, SchedulerOutput
from kvmesh.model_worker.scheduling.request import Request, RequestStatus


class Scheduler:
    """FCFS scheduler over one KVCacheManager.

    Args:
        config: batch limits.
        kv_cache_manager: the block tables; it must be able to hold one request of
            ``max_model_len`` tokens, so that a request alone always fits.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager) -> None:
        config.validate()
        needed = kv_cache_manager.max_blocks_per_request(config.max_model_len, config.max_num_batched_tokens)
        if needed > kv_cache_manager.num_blocks - 1:
            usable_tokens = (kv_cache_manager.num_blocks - 1) * kv_cache_manager.block_size
            raise ValueError(
                f"the KV cache holds {usable_tokens} tokens in {kv_cache_manager.num_blocks - 1} blocks, "
                f"fewer than max_model_len ({config.max_model_len}) needs ({needed} blocks over "
                f"{kv_cache_manager.num_groups} KV cache groups): lower max_model_len or give it more blocks"
            )
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        # NOTE: running is in admission order; the last one is the first to be preempted.
        self.running: list[Request] = []
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        # NOTE: with full attention only, an inner window step changes the block tables only when
        # its token completes a block (then it is cached); sliding windows also free blocks.
        self._full_attention_only = kv_cache_manager.kv_cache_config.full_attention_only

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt (or recompute) tokens not computed yet, over waiting and running requests.

        Waiting requests count their tokens less the prefix the cache held when they were queued (the
        hit itself is taken at admission): counted whole, a holder of a long shared prefix reported
        ~9x its work (8k cached + 1k new per request) and routers sent the prefix's requests elsewhere.
        """
        total = sum(r.num_tokens - max(r.num_computed_tokens, r.num_cached_hint) for r in self.waiting)
        for r in self.running:
            if r.num_output_tokens == 0 or r.num_computed_tokens < r.num_tokens - 1:
                # NOTE: a started step's tokens count as computed (async scheduling): never below 0.
                total += max(0, r.num_tokens - r.num_computed_tokens)
        return total

    @property
    def prefilling_tokens(self) -> int:
        """Uncached prompt tokens of the requests without a token yet, each counted whole until its first
        token (not the part still to compute): what a router counts of its own requests in flight
        (router/core/inflight.py); the report gives every router the sum over all of them."""
        total = sum(r.num_prompt_tokens - r.num_cached_hint for r in self.waiting if not r.num_output_tokens)
        for r in self.running:
            if not r.num_output_tokens:
                total += r.num_prompt_tokens - max(0, r.num_cached_tokens)
        return total

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(self, request: Request) -> None:
        """Queues a request. Raises ValueError on one that could never be served."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_prompt_tokens == 0:
            raise ValueError("the prompt is empty; it needs at least one token")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError(
                f"the prompt has {request.num_prompt_tokens} tokens but max_model_len is "
                f"{self.config.max_model_len}; it must be shorter to leave room for one generated token"
            )
        hasher = request.block_hasher
        if hasher is not None and hasher.block_size != self.kv_cache_manager.block_size:
            raise ValueError(
                f"the request hashes blocks of {hasher.block_size} tokens, "
                f"the KV cache has blocks of {self.kv_cache_manager.block_size}"
            )
        request.sampling_params.validate()
        request.status = RequestStatus.WAITING
        request.num_cached_hint = self.kv_cache_manager.cached_prefix_tokens(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_request(self, request_id: str) -> bool:
        """Finishes a live request as aborted and frees its blocks; False when none is live."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.config.max_num_batched_tokens
        kv = self.kv_cache_manager
        bs = kv.block_size
        lazy = self._full_attention_only

        # Running requests first: decodes and the next chunks of prompts being prefilled.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            placeholders = request.num_output_placeholders
            if placeholders and self._last_by_length(request):
                i += 1  # its token in flight is its last: nothing to compute after it
                continue
            num_new = min(request.num_tokens + placeholders - request.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            # NOTE: a decode whose token neither needs a new block nor completes one changes
            # nothing in the pool (full attention only): allocate_slots would allocate and cache
            # nothing, so it is skipped, as in prepare_window_step. Most decode steps are such.
            # Blocks are cached over known tokens (num_tokens), slots cover placeholders too.
            skip = (lazy and num_new == 1 and request.num_tokens % bs
                    and kv.num_request_blocks(request.request_id) * bs >= request.num_tokens + placeholders)
            if not skip and not self._allocate_or_preempt(request, num_new, out):
                break  # it preempted itself: every request after it is preempted already
            self._add_scheduled(out, request, num_new, request.num_computed_tokens)
            budget -= num_new
            i += 1

        # Then admit waiting requests, oldest (or most recently preempted) first.
        # NOTE: no admission in a step that preempted: the pool is known to be short.
        num_admitted = 0
        # NOTE: LoRA: the running requests never hold more distinct adapters than the device has slots
        # (max_adapters_per_step), so every step's adapters fit; a request of one more adapter waits,
        # and the requests behind it may start meanwhile (as vLLM's scheduler skips it).
        max_adapters = self.config.max_adapters_per_step
        adapters = {r.lora_name for r in self.running if r.lora_name} if max_adapters is not None else set()
        j = 0
        while j < len(self.waiting) and budget > 0 and not out.preempted_ids:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting[j]
            lora = request.lora_name
            if max_adapters is not None and lora and lora not in adapters and len(adapters) >= max_adapters:
                j += 1
                continue
            if request.num_output_placeholders:
                break  # preempted while its last step was in flight: it waits for that token
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            # NOTE: a prefix that continues in the host tier is loaded back, not computed: its
            # tokens count as cached and take no budget; the load runs before this step's forward
            # pass (SchedulerOutput.kv_transfers), so the request computes from after it at once.
            host_blocks = kv.get_host_blocks(request, num_hit)
            num_hit += len(host_blocks) * kv.block_size
            num_new = request.num_tokens - num_hit
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            if kv.allocate_slots(request, num_new, num_hit, hit_blocks, host_blocks=host_blocks) is None:
                break
            del self.waiting[j]
            if lora:
                adapters.add(lora)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            self._add_scheduled(out, request, num_new, num_hit)
            budget -= num_new
            num_admitted += 1
        # NOTE: admission comes first, so a window runs only when no waiting request could start
        # now; an arrival waits at most the rest of one window.
        if self.config.num_scheduler_steps > 1 and not out.preempted_ids and num_admitted == 0:
            self._plan_window(out)
        out.kv_transfers = kv.take_transfers()
        return out

    def _plan_window(self, out: SchedulerOutput) -> None:
        """Turns an all-decode batch into a multi-step window when the pool has the lookahead slots."""
        if not out.scheduled or any(s.num_new_tokens != 1 or not s.sample for s in out.scheduled):
            return
        kv = self.kv_cache_manager
        steps: list[int] = []
        extra_blocks = 0
        for s in out.scheduled:
            r = s.request
            # NOTE: a request gets no more steps than it may still produce tokens, so lookahead
            # never reaches past max_tokens or max_model_len.
            ph = r.num_output_placeholders
            left = min(r.sampling_params.max_tokens - r.num_output_tokens - ph, self.config.max_model_len - r.num_tokens - ph)
            k = max(1, min(self.config.num_scheduler_steps, left))
            steps.append(k)
            # NOTE: counted in every group (tables have one length); sliding windows may need fewer.
            extra_blocks += kv.num_groups * max(
                0, -(-(r.num_computed_tokens + k) // kv.block_size) - kv.num_request_blocks(r.request_id))
        if max(steps) == 1 or extra_blocks > kv.num_free_blocks:
            return  # nothing to gain, or too few free blocks for the lookahead: one step
        for s, k in zip(out.scheduled, steps, strict=True):
            s.window_steps = k
            if k > 1:
                got = kv.allocate_slots(s.request, 1, num_lookahead_tokens=k - 1)
                assert got is not None, "lookahead blocks were counted as free"
                s.tables = None  # NOTE: re-read with the lookahead blocks
        out.num_steps = max(steps)

    def prepare_window_step(self, output: SchedulerOutput) -> list[str]:
        """Readies the next inner step of a window; returns the ids of its requests still running.

        Caches the blocks the step's input tokens fill, exactly as ``schedule()`` would have for
        a one-step batch, so block events and the prefix cache equal those of one-step decoding.
        """
        kv = self.kv_cache_manager
        bs = kv.block_size
        lazy = self._full_attention_only
        active: list[str] = []
        for s in output.scheduled:
            r = s.request
            if r.status != RequestStatus.RUNNING:
                continue  # finished or aborted mid-window: it leaves the batch
            if lazy and r.num_tokens % bs:
                active.append(r.request_id)  # no block completes at this token: nothing to cache
                continue
            # NOTE: the window's lookahead covers every step the request can still take, so this
            # allocates nothing; it only caches newly full blocks, as schedule() would.
            assert kv.num_request_blocks(r.request_id) * kv.block_size >= r.num_tokens, "inner step past the lookahead slots"
            got = kv.allocate_slots(r, 1)
            assert got == [], "an inner step needed a block outside its window's lookahead"
            active.append(r.request_id)
        return active

    def _add_scheduled(self, out: SchedulerOutput, request: Request, num_new: int, start: int) -> None:
        out.scheduled.append(
            ScheduledRequest(
                request=request,
                num_new_tokens=num_new,
                start=start,
                kv_cache_manager=self.kv_cache_manager,
                sample=start + num_new == request.num_tokens + request.num_output_placeholders,
            )
        )
        out.num_scheduled_tokens += num_new

    def _last_by_length(self, request: Request) -> bool:
        """Whether the request's placeholders take it to max_tokens or max_model_len."""
        ph = request.num_output_placeholders
        return (request.num_output_tokens + ph >= request.sampling_params.max_tokens
                or request.num_tokens + ph >= self.config.max_model_len)

    def start_step(self, output: SchedulerOutput) -> None:
        """Async scheduling: ``output`` was launched and the next ``schedule()`` may come before its
        ``update_from_output()``. Its tokens count as computed now; each token it samples is a
        placeholder until ``update_from_output()`` brings it. One step in flight at a time."""
        assert not output.started and output.num_steps == 1, "a window is never started ahead"
        for s in output.scheduled:
            request = s.request
            request.num_computed_tokens += s.num_new_tokens
            if s.sample:
                # NOTE: 2 until the step before is committed (right after this one's launch).
                request.num_output_placeholders += 1
        output.started = True

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocates for a running request, preempting from the back until it fits.

        Returns False when the request itself had to be preempted.
        """
        while self.kv_cache_manager.allocate_slots(request, num_new) is None:
            victim = self.running.pop()
            self._preempt(victim)
            out.preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        # NOTE: preemption by recompute: the blocks go back to the pool (their full blocks stay
        # cached, so re-admission usually hits them) and every token is computed again.
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> list[RequestOutput]:
        """Records a step's results.

        Args:
            output: what ``schedule()`` returned for this step.
            sampled: request id -> tokens sampled for it (requests with ``sample`` only).

        Returns:
            One RequestOutput per request that got tokens or finished, in batch order.
        """
        results: list[RequestOutput] = []
        for sched in output.scheduled:
            request = sched.request
            if request.is_finished:  # aborted after schedule() (or, async, stopped by the step before)
                continue
            if output.started:
                # NOTE: counted at start_step(). The request may have been preempted since (by the
                # next schedule()): its token is still right (its blocks were intact when the step
                # ran) and it keeps it, as it would have without async scheduling.
                if sched.sample:
                    request.num_output_placeholders -= 1
            else:
                request.num_computed_tokens += sched.num_new_tokens
            new_ids: list[int] = []
            if sched.sample:
                for token in sampled.get(request.request_id, ()):
                    _, status = self.stop_after(request, (token,))
                    request.append_output_token_ids(token)
                    new_ids.append(token)
                    if status is not None:
                        _ = sched.block_tables  # NOTE: this step's table, read before the blocks go
                        if request.status == RequestStatus.RUNNING:
                            self.running.remove(request)
                        else:  # preempted while this step was in flight
                            self.waiting.remove(request)
                        self._finish(request, status)
                        break
            if new_ids or request.is_finished:
                results.append(
                    RequestOutput(
                        request_id=request.request_id,
                        new_token_ids=new_ids,
                        finished=request.is_finished,
                        finish_reason=request.finish_reason,
                        num_prompt_tokens=request.num_prompt_tokens,
                        num_cached_tokens=request.num_cached_tokens,
                    )
                )
        return results

    def stop_after(self, request: Request, tokens: Sequence[int]) -> tuple[int, RequestStatus | None]:
        """The stop rule: of ``tokens`` about to be appended to ``request``, how many it takes and
        the status it finishes with after them (None: it goes on).

        A stop token (EOS unless ignored, or one of ``stop_token_ids``) ends it and is kept; else
        reaching ``max_tokens`` or ``max_model_len`` does. A stop token wins over the length limit
        on the same token.
        """
        params = request.sampling_params
        take, status = len(tokens), None
        stops = params.stop_token_ids
        eos = None if params.ignore_eos else request.eos_token_id
        for i, t in enumerate(tokens):
            if t == eos or t in stops:
                take, status = i + 1, RequestStatus.FINISHED_STOPPED
                break
        room = min(params.max_tokens - request.num_output_tokens, self.config.max_model_len - request.num_tokens)
        if room < take or (room == take and status is None):
            take, status = room, RequestStatus.FINISHED_LENGTH
        return take, status

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)
