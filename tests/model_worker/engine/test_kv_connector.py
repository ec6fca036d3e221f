"""The engine's side of prefill/decode disaggregation (engine/kv_connector.py) on a bare block pool: a prefill
leg's hold and the future that answers it, an aborted leg, a PullKV read that outlives a release, a decode leg's
import; and the engine's inbox calls that carry the transfer side's questions. Exact block ids and free-queue
order, as tests/model_worker/scheduling/test_block_pool.py."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.engine.kv_connector import KVConnector
from kvmesh.model_worker.engine.kv_legs import DecodeLeg, HeldKV, KVImport, PrefillLeg
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from kvmesh.model_worker.scheduling.block_pool import BlockPool
from kvmesh.model_worker.scheduling.output import RequestOutput
from kvmesh.model_worker.scheduling.request import Request

BS = 4
HASHER = BlockHasher("test-model", block_size=BS)


def request(rid: str = "p", n: int = 12) -> Request:
    return Request(rid, list(range(2, 2 + n)), SamplingParams(max_tokens=1), block_hasher=HASHER)


def ended(rid: str = "p", reason: str = "length") -> RequestOutput:
    return RequestOutput(rid, [7], True, reason, 12, 0)


def free_ids(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]


def prefilled(r: Request) -> BlockPool:
    """A pool of 10 blocks just after ``r``'s prefill: its full blocks 1, 2, 3 cached and freed (tail first)."""
    pool = BlockPool(10)
    blocks = pool.get_new_blocks(len(r.block_hashes))
    pool.cache_imported(blocks, r.block_hashes, None)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    return pool


def test_a_prefill_leg_holds_the_blocks_before_its_last_token_and_answers_through_its_future():
    r = request()  # 12 tokens: 3 full blocks, the decode worker recomputes the last token: 2 usable
    pool = prefilled(r)
    kvc = KVConnector(pool, None, BS)
    leg = PrefillLeg(5.0, held=Future())
    kvc.add(r, leg)
    assert kvc.has_prefill_legs and not leg.held.done()
    kvc.finished([RequestOutput("p", [7], False, None, 12, 0)], now=100.0)  # not ended: nothing yet
    assert not leg.held.done()
    kvc.finished([ended()], now=100.0)
    assert leg.held.result(0) == HeldKV(tuple(r.block_hashes[:2]), (1, 2))
    assert not kvc.has_prefill_legs and kvc.num_held == 1
    assert free_ids(pool) == [4, 5, 6, 7, 8, 9, 3]
    assert kvc.expire(104.9) == [] and kvc.expire(105.0) == ["p"]
    # released tail first; the blocks stay cached
    assert free_ids(pool) == [4, 5, 6, 7, 8, 9, 3, 2, 1]
    assert kvc.leading_cached(r.block_hashes) == 3


@pytest.mark.parametrize("how", ["aborted before it ended", "ended by an abort"])
def test_an_aborted_prefill_leg_holds_nothing_and_its_future_says_so(how):
    r = request()
    pool = prefilled(r)
    kvc = KVConnector(pool, None, BS)
    leg = PrefillLeg(5.0, held=Future())
    kvc.add(r, leg)
    if how == "aborted before it ended":
        kvc.aborted("p")
    else:
        kvc.finished([ended(reason="abort")], now=100.0)
    assert leg.held.result(0) is None
    assert kvc.num_held == 0 and free_ids(pool) == [4, 5, 6, 7, 8, 9, 3, 2, 1]


def test_a_read_keeps_the_blocks_of_a_hold_released_meanwhile():
    r = request()
    pool = prefilled(r)
    kvc = KVConnector(pool, None, BS)
    kvc.add(r, PrefillLeg(5.0))
    kvc.finished([ended()], now=100.0)
    assert kvc.begin_read("other") is None
    read_id, held = kvc.begin_read("p")
    assert held == HeldKV(tuple(r.block_hashes[:2]), (1, 2))
    # ReleaseKV (or the ttl) while the PullKV stream copies the bytes: the hold is gone, its blocks are not
    assert kvc.release("p") and not kvc.holds.holds
    assert free_ids(pool) == [4, 5, 6, 7, 8, 9, 3] and kvc.holds.num_held_blocks == 2
    assert not kvc.release("p")
    kvc.end_read(read_id, "p", release=False)
    assert free_ids(pool) == [4, 5, 6, 7, 8, 9, 3, 2, 1] and kvc.holds.num_held_blocks == 0


def test_a_finished_read_releases_its_own_hold_not_a_newer_one_of_the_same_id():
    r = request()
    pool = prefilled(r)
    kvc = KVConnector(pool, None, BS)
    kvc.add(r, PrefillLeg(5.0))
    kvc.finished([ended()], now=100.0)
    read_id, _ = kvc.begin_read("p")
    kvc.add(r, PrefillLeg(5.0))  # the same id's prefill leg again: its hold replaces the one being read
    kvc.finished([ended()], now=101.0)
    newer = kvc.holds.holds["p"]
    assert [b.ref_cnt for b in newer.blocks] == [2, 2]  # the old hold (being read) and the new one
    kvc.end_read(read_id, "p", release=True)
    assert kvc.holds.holds["p"] is newer and [b.ref_cnt for b in newer.blocks] == [1, 1]
    assert kvc.release("p") and free_ids(pool) == [4, 5, 6, 7, 8, 9, 3, 2, 1]


def test_a_decode_leg_takes_in_the_blocks_past_the_prefix_the_pool_holds():
    r = request()
    pool = BlockPool(10)
    kvc = KVConnector(pool, None, BS)
    # the pull found none of the 2 offered blocks here; the simulator's imports carry no bytes
    kv = KVImport(list(r.block_hashes[:2]), 0, None, num_blocks=2)
    kvc.add(r, DecodeLeg(kv))
    assert kv.taken == 2 and kvc.leading_cached(r.block_hashes) == 2
    assert free_ids(pool) == [3, 4, 5, 6, 7, 8, 9] and list(kvc.holds.imports) == ["p"]
    kvc.scheduled({"p": r}, now=0.0)  # still waiting: the import keeps its references
    assert list(kvc.holds.imports) == ["p"]
    kvc.scheduled({}, now=0.0)  # admitted (or gone): the request's own hit holds them now
    assert not kvc.holds.imports and free_ids(pool) == [3, 4, 5, 6, 7, 8, 9, 2, 1]


def test_the_engines_inbox_answers_calls_with_futures_and_an_error_never_fails_a_step(tiny_model_dir):
    engine = LLMEngine(model=str(tiny_model_dir("llama")), num_blocks=32, max_model_len=128)
    asked = engine.call_on_step_thread(lambda e: e.kv_connector.leading_cached([b"\0" * 16]))
    broken = engine.call_on_step_thread(lambda e: e.kv_connector.end_read(42, "nobody", release=True))
    assert engine.has_unfinished_requests() and not asked.done()
    assert engine.step() == []
    assert asked.result(0) == 0
    with pytest.raises(KeyError):
        broken.result(0)
    assert not engine.has_unfinished_requests()
