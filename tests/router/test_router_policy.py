"""Routing policies on constructed candidate sets: exact picks and reasons."""

from __future__ import annotations

import hashlib

import pytest

from kvmesh.contract.types import Load
from kvmesh.router.policy import (
    POLICIES,
    Candidate,
    KvAwarePolicy,
    PolicyConfig,
    PrefixHashPolicy,
    RouteQuery,
    make_policy,
    queued_tokens,
    rendezvous_weight,
)

BS = 16


def chain(n: int, tag: str = "p") -> list[bytes]:
    return [hashlib.sha256(f"{tag}{i}".encode()).digest()[:16] for i in range(n)]


def query(prompt_len: int, index_ok: bool = True, tag: str = "p") -> RouteQuery:
    return RouteQuery(prompt_len, BS, chain(prompt_len // BS, tag), index_ok)


def cand(wid: str, matched: int = 0, queued_prefill: int = 0, running: int = 0, **kw) -> Candidate:
    return Candidate(wid, f"{wid}:1", matched, Load(num_running=running, queued_prefill_tokens=queued_prefill), **kw)


def kv_aware(seed: int = 0, **kw) -> KvAwarePolicy:
    return KvAwarePolicy(PolicyConfig(seed=seed, **kw))


def test_prefix_holder_wins_when_idle():
    d = kv_aware().pick(query(1024), [cand("a", matched=48), cand("b")])
    # a: 1024 - 48*16 = 256 uncached tokens; b: 1024.
    assert (d.worker_id, d.reason, d.score) == ("a", "prefix", 256)


def test_much_more_loaded_holder_loses_to_idle_worker():
    # a: 256 uncached + 2000 queued prefill + 4 running * 32 = 2384; b: 1024 uncached, idle.
    d = kv_aware().pick(query(1024), [cand("a", matched=48, queued_prefill=2000, running=4), cand("b")])
    assert (d.worker_id, d.reason, d.score) == ("b", "load", 1024)


def test_overlap_weight_trades_queue_for_cache_hits():
    cands = [cand("a", matched=48, queued_prefill=1000), cand("b")]
    # weight 1: a = 256 + 1000 = 1256 > b = 1024; weight 2: a = 512 + 1000 = 1512 < b = 2048.
    assert kv_aware(overlap_weight=1.0).pick(query(1024), cands).worker_id == "b"
    d = kv_aware(overlap_weight=2.0).pick(query(1024), cands)
    assert (d.worker_id, d.reason, d.score) == ("a", "prefix", 1512)
    # weight 0: cache is ignored, pure least queued work
    assert kv_aware(overlap_weight=0.0).pick(query(1024), [cand("a", matched=48, queued_prefill=1), cand("b")]).worker_id == "b"


def test_queued_work_is_max_of_reported_and_own_view_not_sum():
    c = cand("a", queued_prefill=500, running=1, inflight_requests=1, inflight_prefill_tokens=1000)
    assert queued_tokens(c, 32) == 1032  # own view (1000 + 32) beats the report (500 + 32)
    c = cand("a", queued_prefill=5000, inflight_requests=2, inflight_prefill_tokens=100)
    assert queued_tokens(c, 32) == 5000


def test_hot_spot_guard_sends_prefix_traffic_away_from_overloaded_holder():
    # A 16k-token prompt fully cached on a: score 6000 beats 16384 at b and c, but a's queue is
    # 3x the mean (2000) and 6000 over the least loaded: the guard picks the least loaded.
    q = query(16384)
    cands = [cand("a", matched=1024, queued_prefill=6000), cand("b"), cand("c")]
    picks = {kv_aware(seed=s).pick(q, cands).worker_id for s in range(20)}
    d = kv_aware().pick(q, cands)
    assert (picks, d.reason, d.score) == ({"b", "c"}, "balance", 0)


def test_hot_spot_guard_needs_the_absolute_margin_too():
    # 2000 queued is 3x the mean (666) but only 2000 over the idle ones (< 2048): no guard.
    q = query(16384)
    d = kv_aware().pick(q, [cand("a", matched=1024, queued_prefill=2000), cand("b"), cand("c")])
    assert (d.worker_id, d.reason, d.score) == ("a", "prefix", 2000)
    d = kv_aware(balance_min_tokens=1000).pick(q, [cand("a", matched=1024, queued_prefill=2000), cand("b"),
                                                   cand("c")])
    assert d.reason == "balance"


def test_ties_are_broken_at_random_and_reproducibly_with_a_seed():
    q = query(64)
    cands = [cand("a"), cand("b"), cand("c")]
    p1, p2, p3 = kv_aware(seed=7), kv_aware(seed=7), kv_aware(seed=8)
    seq1 = [p1.pick(q, cands).worker_id for _ in range(60)]
    seq2 = [p2.pick(q, cands).worker_id for _ in range(60)]
    seq3 = [p3.pick(q, cands).worker_id for _ in range(60)]
    assert set(seq1) == {"a", "b", "c"}
    assert seq1 == seq2 and seq1 != seq3


def test_rendezvous_is_stable_when_an_unrelated_worker_leaves():
    workers = [cand(f"w{i}") for i in range(5)]
    policy = PrefixHashPolicy(PolicyConfig(seed=0))
    before = {t: policy.pick(query(128, tag=t), workers).worker_id for t in (f"k{i}" for i in range(200))}
    assert set(before.values()) == {f"w{i}" for i in range(5)}  # keys spread over every worker
    after = {t: policy.pick(query(128, tag=t), [w for w in workers if w.worker_id != "w3"]).worker_id
             for t in before}
    moved = {t for t in before if before[t] != after[t]}
    assert moved == {t for t in before if before[t] == "w3"} and moved


def test_rendezvous_key_is_the_leading_blocks_only():
    workers = [cand(f"w{i}") for i in range(5)]
    policy = PrefixHashPolicy(PolicyConfig(fallback_prefix_blocks=4))
    q = query(128)
    longer = RouteQuery(256, BS, [*q.block_hashes[:4], *chain(12, "other")])
    assert policy.pick(q, workers).worker_id == policy.pick(longer, workers).worker_id


def test_rendezvous_skips_overloaded_worker_to_next_in_hash_order():
    workers = [cand(f"w{i}") for i in range(4)]
    q = query(128)
    key = q.block_hashes[3]
    order = sorted((w.worker_id for w in workers), key=lambda w: rendezvous_weight(key, w), reverse=True)
    policy = PrefixHashPolicy()
    assert policy.pick(q, workers).worker_id == order[0]
    loaded = [cand(w.worker_id, queued_prefill=10_000 if w.worker_id == order[0] else 0) for w in workers]
    d = policy.pick(q, loaded)
    assert (d.worker_id, d.reason) == (order[1], "prefix_hash")


def test_kv_aware_without_index_falls_back_to_rendezvous():
    workers = [cand(f"w{i}") for i in range(4)]
    q = query(128, index_ok=False)
    d = kv_aware().pick(q, workers)
    assert (d.worker_id, d.reason) == (PrefixHashPolicy().pick(q, workers).worker_id, "fallback")


def test_round_robin_and_least_loaded():
    rr = make_policy("round-robin")
    cands = [cand("b"), cand("a"), cand("c")]
    assert [rr.pick(query(32), cands).worker_id for _ in range(4)] == ["a", "b", "c", "a"]
    ll = make_policy("least-loaded", PolicyConfig(seed=1))
    d = ll.pick(query(32), [cand("a", matched=2, running=3), cand("b", queued_prefill=50), cand("c", running=2)])
    assert (d.worker_id, d.reason, d.score) == ("b", "least_loaded", 50)


def test_registry_names_and_unknown_policy():
    assert list(POLICIES) == ["kv-aware", "round-robin", "least-loaded", "prefix-hash", "approx-tree"]
    with pytest.raises(ValueError, match="unknown policy 'random'; choose one of kv-aware, round-robin"):
        make_policy("random")
