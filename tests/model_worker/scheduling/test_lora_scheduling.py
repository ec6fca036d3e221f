"""LoRA in the scheduler and the prefix cache: distinct adapters per step capped at --max-loras, and
block hashes keyed by adapter (unchanged without one)."""

from __future__ import annotations

from kvmesh.contract.block_hash import BlockHasher, adapter_extra_keys, adapter_hasher
from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.scheduling.config import SchedulerConfig
from kvmesh.model_worker.scheduling.kv_cache_manager import KVCacheManager
from kvmesh.model_worker.scheduling.request import Request
from kvmesh.model_worker.scheduling.scheduler import Scheduler

BS = 4
HASHER = BlockHasher("test-model", block_size=BS)


def make_scheduler(max_adapters: int | None, num_blocks: int = 64, **config) -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=BS, enable_caching=True)
    return Scheduler(SchedulerConfig(max_model_len=64, max_adapters_per_step=max_adapters, **config), kv)


def request(rid: str, lora: str | None, prompt: list[int] | None = None, max_tokens: int = 3) -> Request:
    tokens = prompt if prompt is not None else [100 + sum(rid.encode()) % 50 + i for i in range(6)]
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   block_hasher=adapter_hasher(HASHER, lora), lora_name=lora)


def run_step(s: Scheduler) -> list[str]:
    out = s.schedule()
    s.update_from_output(out, {r.request.request_id: [7] for r in out.scheduled if r.sample})
    return [r.request.request_id for r in out.scheduled]


def test_distinct_adapters_per_step_are_capped_and_the_rest_wait() -> None:
    s = make_scheduler(max_adapters=2)
    for rid, lora in [("a1", "A"), ("b1", "B"), ("c1", "C"), ("a2", "A"), ("base", None), ("c2", "C")]:
        s.add_request(request(rid, lora))
    # C would be a third adapter: its requests wait; those behind them (A's, the base) start.
    assert run_step(s) == ["a1", "b1", "a2", "base"]
    assert [r.request_id for r in s.waiting] == ["c1", "c2"]
    assert {r.lora_name for r in s.running} == {"A", "B", None}
    while s.running:  # until A's and B's requests finish, C waits
        assert run_step(s) and [r.request_id for r in s.waiting] == ["c1", "c2"]
    assert run_step(s) == ["c1", "c2"]


def test_one_slot_serves_one_adapter_at_a_time_with_the_base_beside_it() -> None:
    s = make_scheduler(max_adapters=1)
    for rid, lora in [("x", "X"), ("y", "Y"), ("b", None)]:
        s.add_request(request(rid, lora))
    assert run_step(s) == ["x", "b"]
    seen: list[set[str | None]] = []
    while s.has_unfinished_requests():
        run_step(s)
        seen.append({r.lora_name for r in s.running} - {None})
    assert all(len(adapters) <= 1 for adapters in seen)


def test_no_cap_without_lora() -> None:
    s = make_scheduler(max_adapters=None)
    for rid, lora in [("a", "A"), ("b", "B"), ("c", "C")]:
        s.add_request(request(rid, lora))
    assert run_step(s) == ["a", "b", "c"]


def test_adapter_keys_leave_base_hashes_unchanged() -> None:
    prompt = list(range(1, 14))
    assert adapter_extra_keys(None) == adapter_extra_keys("") == ()
    assert adapter_hasher(HASHER, None) is HASHER
    base = request("r", None, prompt).block_hashes
    assert base == HASHER.hash_prompt(prompt)
    # the pinned vector of docs/block-hashing.md: no extra keys
    spec = BlockHasher("tiny-llama", block_size=4)
    assert [h.hex() for h in spec.hash_prompt([1, 2, 3, 4, 5, 6, 7, 8, 9])] == [
        "b390c8ff92857d86ee49e8296732eec9", "0c15512b09a48b787177ee9ad95256cc"]
    assert adapter_hasher(spec, None).hash_prompt([1, 2, 3, 4]) == spec.hash_prompt([1, 2, 3, 4])


def test_adapter_name_enters_every_block_as_an_extra_key() -> None:
    prompt = list(range(1, 14))
    under_a = request("r", "sql", prompt).block_hashes
    under_b = request("r", "chat", prompt).block_hashes
    base = HASHER.hash_prompt(prompt)
    assert under_a == BlockHasher("test-model", block_size=BS, extra_keys=("sql",)).hash_prompt(prompt)
    assert len(set(under_a) | set(under_b) | set(base)) == 3 * len(base)  # three disjoint chains
    # the same root: the adapter is in every block, not the root (what vLLM's extra_keys and the bridge do)
    assert adapter_hasher(HASHER, "sql").root() == HASHER.root()
    # generated tokens extend the chain under the same key
    r = request("g", "sql", prompt[:12])
    r.append_output_token_ids([5, 6, 7, 8])
    assert r.block_hashes == adapter_hasher(HASHER, "sql").hash_prompt(prompt[:12] + [5, 6, 7, 8])


def test_prefix_cache_hits_only_under_the_same_adapter() -> None:
    s = make_scheduler(max_adapters=4)
    prompt = list(range(1, 18))  # 4 full blocks
    s.add_request(request("first", "A", prompt, max_tokens=1))
    while s.has_unfinished_requests():
        run_step(s)
    for rid, lora in [("other", "B"), ("base", None), ("same", "A")]:
        s.add_request(request(rid, lora, prompt, max_tokens=3))
    run_step(s)
    hits = {rid: s.requests[rid].num_cached_tokens for rid in ("other", "base", "same") if rid in s.requests}
    assert hits == {"other": 0, "base": 0, "same": 16}


def test_a_stored_event_names_the_adapter_its_blocks_were_computed_under() -> None:
    s = make_scheduler(max_adapters=4)
    prompt = list(range(1, 18))  # 4 full blocks
    for rid, lora in [("a", "A"), ("base", None)]:
        s.add_request(request(rid, lora, prompt, max_tokens=1))
        while s.has_unfinished_requests():
            run_step(s)
    from kvmesh.contract.convert import event_to_pb, events_from_pb
    from kvmesh.contract.types import BlockStored

    stored = [e for e in s.kv_cache_manager.take_events() if isinstance(e, BlockStored)]
    assert [(e.adapter, len(e.block_hashes)) for e in stored] == [("A", 4), ("", 4)]
    assert events_from_pb([event_to_pb(e) for e in stored]) == stored  # on the wire too
    import pytest

    from kvmesh.contract.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match=r"events\[0\].stored.adapter has 257 characters"):
        events_from_pb([event_to_pb(BlockStored(stored[0].block_hashes, adapter="x" * 257))])
