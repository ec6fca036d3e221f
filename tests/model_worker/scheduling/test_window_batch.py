"""The simulator's WindowScheduler.update_from_window (kvmesh/sim/engine.py: a whole multi-step
window committed at once) against the production scheduler's per-step path (update_from_output + prepare_window_step
after every inner step): the same tokens, finishes, free queue, prefix cache and block events."""

from __future__ import annotations

import pytest

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import BlockRemoved, BlockStored, SamplingParams
from kvmesh.model_worker.scheduling.config import SchedulerConfig
from kvmesh.model_worker.scheduling.kv_cache_manager import KVCacheManager
from kvmesh.model_worker.scheduling.kv_cache_spec import KVCacheConfig
from kvmesh.model_worker.scheduling.request import Request
from kvmesh.model_worker.scheduling.scheduler import Scheduler
from kvmesh.sim.engine import WindowScheduler

BS = 16
EOS = 1
HASHER = BlockHasher("m", BS)


def token(rid: str, position: int) -> int:
    """Deterministic tokens; request r2 samples EOS at position 70 (mid-window)."""
    if rid == "r2" and position == 70:
        return EOS
    return 2 + (int(rid[1:]) * 131 + position * 17) % 500


def requests() -> list[Request]:
    out = []
    for i, (n, max_tokens, stop) in enumerate([(40, 37, []), (33, 50, []), (50, 60, []), (17, 9, [99]), (64, 23, [])]):
        prompt = [2 + (7 * i + k) % 300 for k in range(n)]
        out.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, stop_token_ids=stop),
                           eos_token_id=EOS, block_hasher=HASHER))
    return out


def scheduler(windows: list[int | None], batched: bool = False) -> Scheduler:
    kv = KVCacheManager(num_blocks=200, block_size=BS, kv_cache_config=KVCacheConfig.from_sliding_windows(windows, BS))
    return (WindowScheduler if batched else Scheduler)(
        SchedulerConfig(max_num_batched_tokens=64, max_model_len=256, num_scheduler_steps=6), kv)


def drive(s: Scheduler, batched: bool) -> tuple[dict[str, list[int]], dict[str, str | None], list]:
    tokens: dict[str, list[int]] = {}
    finish: dict[str, str | None] = {}
    events = []
    for r in requests():
        s.add_request(r)
    while s.has_unfinished_requests():
        out = s.schedule()
        if out.num_steps == 1:
            sampled = {x.request.request_id: [token(x.request.request_id, x.request.num_tokens)]
                       for x in out.scheduled if x.sample}
            outputs = s.update_from_output(out, sampled)
        elif batched:
            sampled = {x.request.request_id: [token(x.request.request_id, x.request.num_tokens + k)
                                              for k in range(x.window_steps)] for x in out.scheduled}
            assert isinstance(s, WindowScheduler)
            outputs = s.update_from_window(out, sampled)
        else:
            outputs = []
            for k in range(out.num_steps):
                live = [x.request for x in out.scheduled if not x.request.is_finished and x.window_steps > k]
                outputs += s.update_from_output(out, {r.request_id: [token(r.request_id, r.num_tokens)] for r in live})
                if k < out.num_steps - 1:
                    s.prepare_window_step(out)
        for o in outputs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finish[o.request_id] = o.finish_reason
        events += s.kv_cache_manager.take_events(all_groups=True)
    return tokens, finish, events


def flat(events: list) -> list[tuple]:
    out = []
    for e in events:
        kind = "S" if isinstance(e, BlockStored) else "R" if isinstance(e, BlockRemoved) else "C"
        out += [(kind, getattr(e, "group_id", 0), h) for h in getattr(e, "block_hashes", [b""])]
    return sorted(out)


@pytest.mark.parametrize("windows", [[None], [None, 48]], ids=["full-attention", "hybrid-sliding-window"])
def test_window_committed_at_once_equals_step_by_step(windows):
    a, b = scheduler(windows), scheduler(windows, batched=True)
    per_step, batched = drive(a, False), drive(b, True)
    assert per_step[0] == batched[0]
    assert per_step[1] == batched[1] and batched[1]["r2"] == "stop" and batched[1]["r0"] == "length"
    assert len(batched[0]["r2"]) < 60  # the EOS came mid-window
    assert flat(per_step[2]) == flat(batched[2])
    pool_a, pool_b = a.kv_cache_manager.block_pool, b.kv_cache_manager.block_pool
    assert [x.block_id for x in pool_a.free_block_queue.get_all_free_blocks()] == \
           [x.block_id for x in pool_b.free_block_queue.get_all_free_blocks()]
    assert [sorted(m) for m in pool_a.cached_blocks_by_group] == [sorted(m) for m in pool_b.cached_blocks_by_group]
