"""What one scheduler step hands on: the batch (SchedulerOutput of ScheduledRequests), its work in the
units a step's time depends on (StepWork), and per request what the step produced (RequestOutput).
The records only; the logic that fills them is scheduler.py (as vLLM v1 keeps sched/output.py apart
from sched/scheduler.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmesh.model_worker.scheduling.block_pool import KVCacheBlock
from kvmesh.model_worker.scheduling.host_block_pool import KVTransfers
from kvmesh.model_worker.scheduling.kv_cache_manager import KVCacheManager
from kvmesh.model_worker.scheduling.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    """Tokens computed for it this step: all_token_ids[start:start + num_new_tokens]."""
    start: int
    """num_computed_tokens before this step: the position of the first new token."""
    sample: bool
    """This step reaches the end of all_token_ids, so the model samples a token for it."""
    window_steps: int = 1
    """In a multi-step window, the inner steps this request has lookahead slots for (it may
    finish sooner); 1 outside windows."""
    kv_cache_manager: KVCacheManager | None = field(default=None, repr=False)
    """Where :attr:`block_tables` comes from, on first use."""
    tables: list[list[int]] | None = field(default=None, repr=False)

    @property
    def block_tables(self) -> list[list[int]]:
        """Per KV cache group, the request's whole block table after this step's allocation (all of
        one length; a sliding-window group has the null block 0 where its window dropped a block).

        Read from the KV cache manager on first use, i.e. by the runner once the whole batch is
        planned: copying every running request's table at every step would cost the scheduler
        O(context) per request per step, and a runner that needs no tables (the simulated one)
        never pays it.

        Valid from ``schedule()`` until the next ``schedule()``: ``update_from_output()`` reads the
        table of a request that finishes before freeing its blocks, so a finished request still
        reports this step's table; a running request's table grows at the next ``schedule()``.
        """
        if self.tables is None:
            assert self.kv_cache_manager is not None, "a scheduled request without its KV cache manager"
            self.tables = self.kv_cache_manager.get_group_block_ids(self.request.request_id)
        return self.tables

    def live_blocks(self) -> list[list[KVCacheBlock]]:
        """Per KV cache group, the request's block list itself (KVCacheManager.live_blocks): O(1),
        current until the next ``schedule()`` or the request's end."""
        assert self.kv_cache_manager is not None, "a scheduled request without its KV cache manager"
        return self.kv_cache_manager.live_blocks(self.request.request_id)

    @property
    def block_ids(self) -> list[int]:
        """Group 0's block table: the only one of a model without windows."""
        return self.block_tables[0]


@dataclass(slots=True)
class StepWork:
    """What one forward pass computes, in the units a step's time depends on (step_time.StepTimeModel,
    and the work counters a worker reports for routers to learn its step time from)."""

    prefill_tokens: int = 0
    """New tokens of prefill chunks (prompts, and recomputed tokens of preempted requests)."""
    prefill_pairs: int = 0
    """Attention (new token x context token) pairs of the prefill chunks: sum n * (start + (n + 1) / 2)."""
    decode_seqs: int = 0
    """Sequences decoding one token."""
    decode_context_tokens: int = 0
    """Context tokens the decoding sequences attend to."""

    def add(self, other: StepWork) -> None:
        self.prefill_tokens += other.prefill_tokens
        self.prefill_pairs += other.prefill_pairs
        self.decode_seqs += other.decode_seqs
        self.decode_context_tokens += other.decode_context_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    """Batch order: running requests first, then newly admitted ones."""
    num_scheduled_tokens: int = 0
    """Sum of num_new_tokens: at most max_num_batched_tokens."""
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    """Requests finished or aborted since the previous step: drop their per-request state."""
    num_steps: int = 1
    """Forward passes to run on this batch; > 1 only when every request in it decodes one token
    per pass and has KV slots for all of them (multi-step decode)."""
    kv_transfers: KVTransfers | None = None
    """Copies between the device and the host tier to run before the forward pass (host_block_pool.py):
    blocks this step's allocations evicted to the host, prefixes loaded back; None = none."""
    started: bool = False
    """``Scheduler.start_step()`` counted its tokens when it was launched (async scheduling)."""
    _work: StepWork | None = field(default=None, repr=False)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    def work(self) -> StepWork:
        """The first (or only) forward pass's work: a row computing one token past its prompt decodes.

        Computed once per output (the runner's cost and the engine's counters both read it).
        """
        if self._work is not None:
            return self._work
        w = self._work = StepWork()
        for s in self.scheduled:
            n = s.num_new_tokens
            if n == 1 and s.start >= s.request.num_prompt_tokens:
                w.decode_seqs += 1
                w.decode_context_tokens += s.start + 1
            else:
                w.prefill_tokens += n
                # NOTE: n * (n + 1) is even: the pair count is exact in integers.
                w.prefill_pairs += n * s.start + n * (n + 1) // 2
        return w


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    """Tokens sampled this step (empty when only finishing)."""
    finished: bool
    finish_reason: str | None
    """"stop" | "length" | "abort" once finished, else None."""
    num_prompt_tokens: int
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache at first admission."""
