"""Routing policies on constructed candidate sets: exact picks and reasons."""

from __future__ import annotations

import hashlib
import math

import pytest

from kvmesh.contract.types import Load
from kvmesh.router.core.policies import make_policy, policy_names
from kvmesh.router.core.policies.base import (
    Candidate,
    PolicyConfig,
    RouteQuery,
    queued_tokens,
    rendezvous_weight,
)
from kvmesh.router.core.policies.kv_aware import KvAwarePolicy

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
    # No step cost learned yet: time in prefill tokens. a: ttft 256 uncached + work 1 x 256 = 512;
    # b: 1024 + 1024 = 2048.
    assert (d.worker_id, d.reason, d.score) == ("a", "prefix", 512)


def test_much_more_loaded_holder_loses_to_idle_worker():
    # a: ttft 2000 queued + 256 = 2256, plus (0.5 x 4 decoding + 1) x 256 = 768 -> 3024;
    # b: idle, 1024 + 1024 = 2048.
    d = kv_aware().pick(query(1024), [cand("a", matched=48, queued_prefill=2000, running=4), cand("b")])
    assert (d.worker_id, d.reason, d.score) == ("b", "load", 2048)


def test_temperature_spreads_picks_by_normalized_score():
    cands = [cand("a", matched=48), cand("b", matched=32), cand("c")]
    # each alone: score = 2 x uncached tokens (ttft u + work u): a 512, b 1024, c 2048
    scores = {c.worker_id: kv_aware().pick(query(1024), [c]).score for c in cands}
    assert scores == {"a": 512, "b": 1024, "c": 2048}
    assert {kv_aware(seed=s).pick(query(1024), cands).worker_id for s in range(50)} == {"a"}  # 0: the best wins
    for t in (0.25, 1.0):
        policy = kv_aware(seed=7, temperature=t)
        picks = [policy.pick(query(1024), cands).worker_id for _ in range(4000)]
        # p(w) ~ exp(-(score - best) / (t * (worst - best)))
        weight = {w: math.exp(-(v - 512) / (t * (2048 - 512))) for w, v in scores.items()}
        for w in scores:
            assert abs(picks.count(w) / len(picks) - weight[w] / sum(weight.values())) < 0.03, (t, w)


def test_work_weight_trades_queue_for_cache_hits():
    cands = [cand("a", matched=48, queued_prefill=1000), cand("b")]
    # weight 1: a = 1256 + 256 = 1512 < b = 1024 + 1024 = 2048; weight 0: latency only,
    # a = 1256 > b = 1024.
    d = kv_aware().pick(query(1024), cands)
    assert (d.worker_id, d.reason, d.score) == ("a", "prefix", 1512)
    d = kv_aware(work_weight=0.0).pick(query(1024), cands)
    assert (d.worker_id, d.reason, d.score) == ("b", "load", 1024)


def test_queued_work_is_max_of_reported_and_own_view_not_sum():
    c = cand("a", queued_prefill=500, running=1, inflight_requests=1, inflight_prefill_tokens=1000)
    assert queued_tokens(c, 32) == 1032  # own view (1000 + 32) beats the report (500 + 32)
    c = cand("a", queued_prefill=5000, inflight_requests=2, inflight_prefill_tokens=100)
    assert queued_tokens(c, 32) == 5000


def test_backlog_makes_recomputing_a_prefix_cost_more():
    # a holds 48 blocks behind 1800 queued tokens. Nothing waiting: a = 2056 + 256 = 2312 >
    # b = 1024 + 1024 = 2048. One request waiting per worker on average (W = 1): the work term
    # doubles, a = 2056 + 512 = 2568 < b = 1024 + 2048 = 3072.
    q = query(1024)
    d = kv_aware().pick(q, [cand("a", matched=48, queued_prefill=1800), cand("b")])
    assert (d.worker_id, d.score) == ("b", 2048)
    waiting = Load(queued_prefill_tokens=1800, num_waiting=1)
    d = kv_aware().pick(q, [Candidate("a", "a:1", 48, waiting), Candidate("b", "b:1", 0, Load(num_waiting=1))])
    assert (d.worker_id, d.reason, d.score) == ("a", "prefix", 2568)


def test_hot_holder_queue_is_in_its_predicted_time():
    # A 16k-token prompt whose 1024 blocks a all holds: a's score is its queue alone. No token
    # guard: a queue of 40000 costs more than recomputing the prompt on an idle worker
    # (16384 + 16384 = 32768), a queue of 20000 does not.
    q = query(16384)
    d = kv_aware().pick(q, [cand("a", matched=1024, queued_prefill=40000), cand("b")])
    assert (d.worker_id, d.reason, d.score) == ("b", "load", 32768)
    d = kv_aware().pick(q, [cand("a", matched=1024, queued_prefill=20000), cand("b")])
    assert (d.worker_id, d.reason, d.score) == ("a", "prefix", 20000)


def test_ties_are_broken_at_random_and_reproducibly_with_a_seed():
    q = query(64)
    cands = [cand("a"), cand("b"), cand("c")]
    p1, p2, p3 = kv_aware(seed=7), kv_aware(seed=7), kv_aware(seed=8)
    seq1 = [p1.pick(q, cands).worker_id for _ in range(60)]
    seq2 = [p2.pick(q, cands).worker_id for _ in range(60)]
    seq3 = [p3.pick(q, cands).worker_id for _ in range(60)]
    assert set(seq1) == {"a", "b", "c"}
    assert seq1 == seq2 and seq1 != seq3


def fallback(q: RouteQuery, workers: list[Candidate], **kw) -> str:
    """The rendezvous fallback a policy takes without the index (base.py, ``rendezvous``)."""
    return kv_aware(**kw).rendezvous(q, workers, "fallback").worker_id


def test_rendezvous_is_stable_when_an_unrelated_worker_leaves():
    workers = [cand(f"w{i}") for i in range(5)]
    before = {t: fallback(query(128, tag=t), workers) for t in (f"k{i}" for i in range(200))}
    assert set(before.values()) == {f"w{i}" for i in range(5)}  # keys spread over every worker
    after = {t: fallback(query(128, tag=t), [w for w in workers if w.worker_id != "w3"]) for t in before}
    moved = {t for t in before if before[t] != after[t]}
    assert moved == {t for t in before if before[t] == "w3"} and moved


def test_rendezvous_key_is_the_leading_blocks_only():
    workers = [cand(f"w{i}") for i in range(5)]
    q = query(128)
    longer = RouteQuery(256, BS, [*q.block_hashes[:4], *chain(12, "other")])
    assert fallback(q, workers, fallback_prefix_blocks=4) == fallback(longer, workers, fallback_prefix_blocks=4)


def test_rendezvous_skips_overloaded_worker_to_next_in_hash_order():
    workers = [cand(f"w{i}") for i in range(4)]
    q = query(128)
    key = q.block_hashes[3]
    order = sorted((w.worker_id for w in workers), key=lambda w: rendezvous_weight(key, w), reverse=True)
    assert fallback(q, workers) == order[0]
    loaded = [cand(w.worker_id, queued_prefill=10_000 if w.worker_id == order[0] else 0) for w in workers]
    assert fallback(q, loaded) == order[1]


def test_kv_aware_without_index_falls_back_to_rendezvous():
    workers = [cand(f"w{i}") for i in range(4)]
    q = query(128, index_ok=False)
    d = kv_aware().pick(q, workers)
    assert (d.worker_id, d.reason) == (fallback(q, workers), "fallback")


def test_round_robin_and_least_loaded():
    cands = [cand("b"), cand("a"), cand("c")]
    rr = make_policy("round-robin")
    picks = [rr.pick(query(32), cands).worker_id for _ in range(6)]
    assert picks[:3] in (["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]) and picks[3:] == picks[:3]
    # routers do not start their rotations together (they would herd the first requests of a burst)
    starts = {make_policy("round-robin", PolicyConfig(seed=s)).pick(query(32), cands).worker_id for s in range(30)}
    assert starts == {"a", "b", "c"}
    ll = make_policy("least-loaded", PolicyConfig(seed=1))
    d = ll.pick(query(32), [cand("a", matched=2, running=3), cand("b", queued_prefill=50), cand("c", running=2)])
    assert (d.worker_id, d.reason, d.score) == ("b", "least_loaded", 50)


def test_registry_names_and_unknown_policy():
    assert policy_names() == ["kv-aware", "round-robin", "least-loaded", "prefix-hash", "approx-tree", "dynamo", "llm-d",
                             "preble", "lmetric", "llm-d-sticky", "llm-d-sticky-decode", "llm-d-predicted",
                             "llm-d-lora-affinity", "llm-d-lora-load-state", "kv-aware-no-residency"]
    with pytest.raises(ValueError, match="unknown policy 'random'; choose one of kv-aware, round-robin"):
        make_policy("random")
