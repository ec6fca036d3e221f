"""The event stream a worker publishes: exact per-step events, and replay == snapshot.

kv_service rebuilds a worker's block set from these events alone, so after every step the
events replayed into a set must equal ``cached_block_hashes()`` (the resync snapshot), and every
BlockStored must name a parent the worker already announced.
"""

from __future__ import annotations

import random

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, SamplingParams
from kvmesh.model_worker.scheduling.config import SchedulerConfig
from kvmesh.model_worker.scheduling.kv_cache_manager import KVCacheManager
from kvmesh.model_worker.scheduling.request import Request
from kvmesh.model_worker.scheduling.scheduler import Scheduler

BS = 4
HASHER = BlockHasher("test-model", block_size=BS)


class ReplayedIndex:
    """What kv_service knows about one worker: the set of hashes it holds."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()
        self.num_removed = 0

    def apply(self, events: list[KVCacheEvent]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                assert e.parent_block_hash is None or e.parent_block_hash in self.hashes, "unknown parent"
                assert e.block_hashes, "empty BlockStored"
                self.hashes.update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= self.hashes, "removal of a hash never stored"
                self.hashes.difference_update(e.block_hashes)
                self.num_removed += len(e.block_hashes)
            else:
                assert isinstance(e, AllBlocksCleared)
                self.hashes.clear()


def make_request(request_id: str, tokens: list[int], max_tokens: int) -> Request:
    return Request(
        request_id, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True), block_hasher=HASHER
    )


def test_events_of_one_request_step_by_step() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=6, max_model_len=20), kv)
    req = make_request("A", list(range(10)), max_tokens=4)  # 10 prompt tokens: chunks of 6 and 4
    s.add_request(req)
    h = req.block_hashes
    assert len(h) == 2

    out = s.schedule()  # tokens 0..5: block 1 full
    assert kv.take_events() == [BlockStored([h[0]], None)]
    s.update_from_output(out, {})
    out = s.schedule()  # tokens 6..9: block 2 full, block 3 partial
    assert kv.take_events() == [BlockStored([h[1]], h[0])]
    s.update_from_output(out, {"A": [10]})
    out = s.schedule()  # token 10 (position 10)
    assert kv.take_events() == []
    s.update_from_output(out, {"A": [11]})  # 12 tokens: the third block is full and hashed
    assert len(req.block_hashes) == 3
    out = s.schedule()  # token 11 fills block 3
    assert kv.take_events() == [BlockStored([req.block_hashes[2]], h[1])]
    s.update_from_output(out, {"A": [12]})
    out = s.schedule()
    s.update_from_output(out, {"A": [13]})  # max_tokens: finished and freed, still cached
    assert not s.has_unfinished_requests()
    assert kv.take_events() == []
    assert kv.cached_block_hashes() == set(req.block_hashes[:3])

    # Queue after A's reverse free: [5, 4, 3, 2, 1]; B's chunks of 6 tokens take 2, 1, 2 blocks.
    # Blocks 5 and 4 (A's partial tail) hold no hash; then A's chain goes from its tail.
    s.add_request(make_request("B", list(range(100, 119)), max_tokens=1))
    b = s.requests["B"].block_hashes
    removed_per_step = []
    for _ in range(3):
        out = s.schedule()
        s.update_from_output(out, {})
        removed_per_step.append([e for e in kv.take_events() if isinstance(e, BlockRemoved)])
    assert kv.get_block_ids("B") == [5, 4, 3, 2, 1]
    assert removed_per_step == [[], [BlockRemoved([req.block_hashes[2]])], [BlockRemoved([h[1], h[0]])]]
    assert kv.cached_block_hashes() == set(b[:4])


def test_replayed_events_match_the_snapshot_under_random_load() -> None:
    rng = random.Random(1234)
    kv = KVCacheManager(num_blocks=12, block_size=BS)  # 11 usable: one 40-token request fits
    s = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=40), kv)
    index = ReplayedIndex()
    prefixes = [[rng.randrange(50) for _ in range(rng.choice((4, 8, 12)))] for _ in range(4)]
    next_id = resets = 0
    for step in range(400):
        if rng.random() < 0.3:
            tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 14))]
            s.add_request(make_request(f"r{next_id}", tokens, max_tokens=rng.randrange(1, 12)))
            next_id += 1
        if s.requests and rng.random() < 0.05:
            s.abort_request(rng.choice(sorted(s.requests)))
        if step % 25 == 24:
            idle = kv.num_free_blocks == kv.num_blocks - 1
            assert kv.reset_prefix_cache() is idle
            resets += idle
        out = s.schedule()
        sampled = {sr.request.request_id: [rng.randrange(50)] for sr in out.scheduled if sr.sample}
        s.update_from_output(out, sampled)
        index.apply(kv.take_events())
        assert index.hashes == kv.cached_block_hashes()
    # The load exercised what the index must follow: hits, preemption, eviction, reset.
    assert s.num_preemptions > 0 and kv.prefix_cache_hits > 0
    assert index.num_removed > 0 and resets > 0
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, {sr.request.request_id: [1] for sr in out.scheduled if sr.sample})
    index.apply(kv.take_events())
    assert index.hashes == kv.cached_block_hashes()
    assert kv.num_free_blocks == 11
    assert kv.reset_prefix_cache()
    index.apply(kv.take_events())
    assert index.hashes == set()


def test_decode_steps_that_skip_the_allocation_change_nothing() -> None:
    """schedule() skips allocate_slots for a decode whose token neither needs a new block nor
    completes one (full attention only): the same random load, once with the skip and once with
    every step allocating, gives the same events, tables, preemptions and outputs step by step."""

    def run(skip: bool) -> tuple[list, int]:
        rng = random.Random(77)
        kv = KVCacheManager(num_blocks=14, block_size=BS)
        s = Scheduler(SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=48), kv)
        s._full_attention_only = skip
        calls = 0
        allocate = kv.allocate_slots

        def counted(*args, **kwargs):
            nonlocal calls
            calls += 1
            return allocate(*args, **kwargs)

        kv.allocate_slots = counted
        prefixes = [[rng.randrange(50) for _ in range(rng.choice((4, 8, 12)))] for _ in range(4)]
        trace = []
        for step in range(300):
            if rng.random() < 0.3:
                tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 14))]
                s.add_request(make_request(f"r{step}", tokens, max_tokens=rng.randrange(1, 20)))
            if s.requests and rng.random() < 0.03:
                s.abort_request(rng.choice(sorted(s.requests)))
            out = s.schedule()
            tables = [(sr.request.request_id, sr.num_new_tokens, sr.block_tables) for sr in out.scheduled]
            sampled = {sr.request.request_id: [rng.randrange(50)] for sr in out.scheduled if sr.sample}
            outs = s.update_from_output(out, sampled)
            trace.append((tables, list(out.preempted_ids), [(o.request_id, o.new_token_ids, o.finished) for o in outs],
                          kv.take_events()))
        assert s.num_preemptions > 0 and kv.prefix_cache_hits > 0  # the load reached both
        return trace, calls

    fast, fast_calls = run(skip=True)
    slow, slow_calls = run(skip=False)
    assert fast_calls < 0.8 * slow_calls, (fast_calls, slow_calls)  # the decodes inside a block skipped it
    for step, (a, b) in enumerate(zip(fast, slow, strict=True)):
        assert a == b, f"step {step}"
