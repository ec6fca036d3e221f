"""The simulator's engine parts: a whole multi-step window in one event.

A simulated worker is the production :class:`LLMEngine` (scheduler, block pool, prefix cache,
events) with two parts injected through its factories:

- :class:`WindowRunner`: the cost-model runner (model_worker/simulated/sim_runner.py) whose ``execute_window``
  computes a whole decode window at once, each inner step costed with the rows still in it, and
  hands the engine every row's tokens in one call; a window ends early at the next arrival
  (``window_deadline_s``) or when a row leaves while requests wait (``stop_window_on_exit``), where
  one-step scheduling would admit a request;
- :class:`WindowScheduler`: the production scheduler plus the commit of such a window: the same
  tokens, the same stop rule (``Scheduler.stop_after``), blocks cached as they complete and
  finished requests freed in step order, so the free queue, the prefix cache and the set of block
  events equal those of step-by-step decoding (only their order within a window differs).

This is the simulator's speed-up, not a model of anything: no per-token round trip through the
engine. It lives here so the production scheduler and engine carry no simulator path.
"""

from __future__ import annotations

from collections.abc import Callable

from kvmesh.model_worker.scheduling.output import RequestOutput, ScheduledRequest, SchedulerOutput
from kvmesh.model_worker.scheduling.request import Request, RequestStatus
from kvmesh.model_worker.scheduling.scheduler import Scheduler
from kvmesh.model_worker.simulated.sim_runner import SimRunner, sim_token_ids


class WindowScheduler(Scheduler):
    """The production scheduler; a window's tokens committed at once (several per row)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._window_done = False

    def update_from_output(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[RequestOutput]:
        if output.num_steps > 1:
            self._window_done = True
            return self.update_from_window(output, sampled)
        return super().update_from_output(output, sampled)

    def prepare_window_step(self, output: SchedulerOutput) -> list[str]:
        # NOTE: the window was committed whole: there is no next inner step to ready.
        if self._window_done:
            self._window_done = False
            return []
        return super().prepare_window_step(output)

    def update_from_window(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[RequestOutput]:
        """Commits a whole multi-step window at once.

        Equivalent to ``update_from_output`` with each inner step's tokens followed by
        ``prepare_window_step`` between steps: the same tokens, stop rules per token, blocks cached
        as they complete, and finished requests freed in step order (then batch order), so the free
        queue, the prefix cache and the set of block events are the same.

        Args:
            output: the window ``schedule()`` returned (``num_steps > 1``).
            sampled: request id -> its tokens, one per inner step it ran (at most its ``window_steps``).

        Returns:
            One RequestOutput per request that got tokens or finished, in batch order, carrying all
            of its tokens of the window.
        """
        if not self._full_attention_only:
            return self._window_step_by_step(output, sampled)
        bs = self.kv_cache_manager.block_size
        results: list[RequestOutput] = []
        finishing: list[tuple[int, int, Request, RequestStatus, ScheduledRequest]] = []
        for pos, sched in enumerate(output.scheduled):
            request = sched.request
            if request.is_finished:  # aborted after schedule()
                continue
            new_ids, status = self._commit_tokens(request, list(sampled.get(request.request_id, ())), bs)
            if status is not None:
                finishing.append((len(new_ids) - 1, pos, request, status, sched))
            if new_ids:
                results.append(RequestOutput(request.request_id, new_ids, False, None,
                                             request.num_prompt_tokens, request.num_cached_tokens))
        # NOTE: frees in step order, as the per-step path would: the free queue's order decides evictions.
        finishing.sort(key=lambda f: (f[0], f[1]))
        done: dict[str, Request] = {}
        for _, _, request, status, sched in finishing:
            _ = sched.block_tables  # NOTE: this step's table, read before the blocks go
            self.running.remove(request)
            self._finish(request, status)
            done[request.request_id] = request
        for i, out in enumerate(results):
            request = done.get(out.request_id)
            if request is not None:
                results[i] = RequestOutput(out.request_id, out.new_token_ids, True, request.finish_reason,
                                           out.num_prompt_tokens, out.num_cached_tokens)
        return results

    def _window_step_by_step(self, output: SchedulerOutput, sampled: dict[str, list[int]]) -> list[RequestOutput]:
        """``update_from_window`` for sliding-window groups: their inner steps free blocks in step
        order, so the window is replayed through the per-step path (one output per request)."""
        merged: dict[str, RequestOutput] = {}
        steps = max(map(len, sampled.values()), default=0)
        for k in range(steps):
            tokens = {rid: [t[k]] for rid, t in sampled.items() if len(t) > k}
            for o in Scheduler.update_from_output(self, output, tokens):
                prev = merged.get(o.request_id)
                if prev is not None:
                    o = RequestOutput(o.request_id, prev.new_token_ids + o.new_token_ids, o.finished, o.finish_reason,
                                      o.num_prompt_tokens, o.num_cached_tokens)
                merged[o.request_id] = o
            if k < steps - 1:
                Scheduler.prepare_window_step(self, output)
        order = {s.request.request_id: i for i, s in enumerate(output.scheduled)}
        return sorted(merged.values(), key=lambda o: order[o.request_id])

    def _commit_tokens(self, request: Request, tokens: list[int], bs: int) -> tuple[list[int], RequestStatus | None]:
        """A window's tokens of one full-attention request, committed a block at a time: between
        inner steps a block is cached when the token just appended completes it; after the last
        inner step, or at a finish, nothing (the next ``schedule()`` does, as for one step)."""
        take, status = self.stop_after(request, tokens)
        kv, last = self.kv_cache_manager, len(tokens) - 1
        pos = 0
        while pos < take:
            # tokens[pos:boundary + 1] bring num_tokens to the next multiple of the block size
            boundary = pos + (bs - request.num_tokens % bs) - 1
            end = min(take, boundary + 1)
            request.num_computed_tokens += end - pos
            request.append_output_token_ids(tokens[pos:end])
            if end - 1 == boundary and boundary < last and not (status is not None and end == take):
                got = kv.allocate_slots(request, 1)  # caches the block this token completed
                assert got == [], "an inner step needed a block outside its window's lookahead"
            pos = end
        return tokens[:take], status


class WindowRunner(SimRunner):
    """The cost-model runner; a multi-step window run and handed over whole (module doc)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.window_deadline_s = float("inf")
        """A window ends after the first inner step that ends at or past this many seconds since it
        began (the simulator sets it to the next arrival)."""
        self.stop_window_on_exit: Callable[[], bool] | None = None
        """Asked when a row leaves a window (it finished); True ends the window there (when requests
        wait for the freed slot)."""
        self.row_elapsed_s: dict[str, float] = {}
        """Per row of the last window: when its last token was ready (seconds since the window began)."""

    def execute(self, out: SchedulerOutput) -> dict[str, list[int]]:
        self.row_elapsed_s = {}
        return super().execute(out)

    def execute_window(self, out: SchedulerOutput, on_step: Callable[[dict[str, list[int]]], list[str]]) -> None:
        """The same inner steps as :meth:`SimRunner.execute_window` (each costed with the rows still
        in it, a row leaving after its ``window_steps``), every row's tokens handed over at once."""
        rows = out.scheduled
        self.step_elapsed_s = 0.0
        self.row_elapsed_s = {}
        if not rows:
            self.last_step_s = 0.0
            return
        deadline, on_exit = self.window_deadline_s, self.stop_window_on_exit
        # NOTE: rows ordered by how many steps they take; the batch shrinks as they run out, and
        # ``base`` (the contexts at step 0 of the rows still in) drops by theirs.
        ends = sorted(s.window_steps for s in rows)
        by_end: dict[int, int] = {}
        for s in rows:
            by_end[s.window_steps] = by_end.get(s.window_steps, 0) + s.start + 1
        n, base = len(rows), sum(by_end.values())
        at_step: list[float] = []
        elapsed, seqs, i, step, last = 0.0, 0, 0, 0, ends[-1]
        step_time, jitter = self.cost.time, (self.jitter if self.noise_sigma else None)
        while step < last:
            t = step_time(0, 0.0, n, base + step * n)
            t = t * jitter() if jitter is not None else t
            elapsed += self.copy_s(t) if step == 0 else t
            seqs += n
            at_step.append(elapsed)
            step += 1
            left = 0
            while i < len(ends) and ends[i] == step:
                i += 1
                left += 1
            if left:
                n -= left
                base -= by_end[step]
            if n == 0 or elapsed >= deadline or (left and on_exit is not None and on_exit()):
                break
        self._account(elapsed, step, 0, seqs)
        self.step_elapsed_s = self.last_step_s = elapsed
        tokens: dict[str, list[int]] = {}
        for s in rows:
            m = min(s.window_steps, step)
            r = s.request
            rid = r.request_id
            stop = r.sampling_params.stop_token_ids
            tokens[rid] = sim_token_ids(rid, r.num_tokens, m, self.vocab_size,
                                        self._eos.union(stop) if stop else self._eos)
            self.row_elapsed_s[rid] = at_step[m - 1]
        on_step(tokens)
