"""The field's policies and the learned-cost kv-aware, each picking as its formula says on
hand-built candidates; the step-cost learner recovering known coefficients."""

from __future__ import annotations

import hashlib

import pytest

from kvmesh.contract.types import Load
from kvmesh.router.policies import POLICIES, make_policy
from kvmesh.router.policies.base import Candidate, PolicyConfig, RouteQuery
from kvmesh.router.policies.cost import StepCostLearner
from kvmesh.router.policies.kv_aware import KvAwarePolicy, predicted_ttft

BS = 16
TRUE = dict(step_s=0.006, prefill_token_s=60e-6, prefill_pair_s=1.3e-9, decode_seq_s=50e-6, decode_context_token_s=40e-9)


def query(prompt_len: int, max_tokens: int = 100) -> RouteQuery:
    chain = [hashlib.sha256(f"b{i}".encode()).digest()[:16] for i in range(prompt_len // BS)]
    return RouteQuery(prompt_len, BS, chain, True, max_tokens)


def cand(wid: str, matched: int = 0, **load) -> Candidate:
    inflight = {k: load.pop(k) for k in list(load) if k.startswith("inflight_")}
    return Candidate(wid, f"{wid}:1", matched, Load(**load), **inflight)


def test_every_policy_is_registered_and_picks_from_one_candidate():
    assert {"kv-aware", "round-robin", "least-loaded", "prefix-hash", "approx-tree", "dynamo", "llm-d", "preble",
            "lmetric"} == set(POLICIES)
    for name in POLICIES:
        assert make_policy(name, PolicyConfig(seed=0)).pick(query(64), [cand("a")]).worker_id == "a"


def test_dynamo_lowest_prefill_plus_decode_blocks():
    # a: holds 48 of 64 blocks, 2000 queued prefill tokens, 100 active blocks:
    #    (2000 + 256) / 16 + (100 + 16) = 141 + 116 = 257
    # b: nothing cached, idle: 1024 / 16 + 64 = 128  -> b
    # c: holds 60 blocks, 10 active: 64 / 16 + (10 + 4) = 18  -> c wins
    q = query(1024)
    cands = [cand("a", 48, queued_prefill_tokens=2000, num_total_blocks=1000, num_free_blocks=900),
             cand("b"), cand("c", 60, num_total_blocks=1000, num_free_blocks=990)]
    d = make_policy("dynamo", PolicyConfig(seed=0)).pick(q, cands)
    assert (d.worker_id, d.score) == ("c", 18)
    # with the overlap weight 0 only the decode blocks count: b (64) beats c (14)? no: c = 14 < b = 64
    assert make_policy("dynamo", PolicyConfig(seed=0, overlap_weight=0.0)).pick(q, cands[:2]).worker_id == "b"


def test_llmd_weighted_prefix_queue_and_kv_usage():
    q = query(1024)  # 64 blocks
    # a: prefix 32/64 -> 3*0.5; queue 4 (the max) -> 0; usage 0.5 -> 2*0.5  = 2.5
    # b: prefix 0; queue 0 (the min) -> 2*1; usage 0 -> 2*1             = 4.0
    # c: prefix 64/64 -> 3; queue 2 -> 2*0.5; usage 0.9 -> 2*0.1          = 4.2
    cands = [cand("a", 32, num_waiting=4, num_total_blocks=100, num_free_blocks=50), cand("b", num_total_blocks=100,
             num_free_blocks=100), cand("c", 64, num_waiting=2, num_total_blocks=100, num_free_blocks=10)]
    d = make_policy("llm-d", PolicyConfig(seed=0)).pick(q, cands)
    assert (d.worker_id, d.score) == ("c", 4200)
    # this router's requests not yet past their first token count as queue when above the report
    cands[2] = cand("c", 64, inflight_waiting=4, num_total_blocks=100, num_free_blocks=10)
    assert make_policy("llm-d", PolicyConfig(seed=0)).pick(q, cands).worker_id == "b"


def test_lmetric_product_of_prefill_tokens_and_batch():
    q = query(1024)
    # a: (0 + 256) * 3 running = 768; b: (1024) * 1 = 1024; c: idle -> 0 whatever its cache
    cands = [cand("a", 48, num_running=3), cand("b", num_running=1), cand("c")]
    assert make_policy("lmetric", PolicyConfig(seed=0)).pick(q, cands).worker_id == "c"
    d = make_policy("lmetric", PolicyConfig(seed=0)).pick(q, cands[:2])
    assert (d.worker_id, d.score) == ("a", 768)


def test_preble_exploits_a_holder_of_most_of_the_prompt_else_explores_the_least_windowed_load():
    now = [0.0]
    p = make_policy("preble", PolicyConfig(seed=0, clock=lambda: now[0]))
    q = query(1024, max_tokens=10)
    # nobody holds anything: explore -> the least windowed load (all 0: ties at random)
    first = p.pick(q, [cand("a"), cand("b")])
    assert first.reason == "explore"
    other = "b" if first.worker_id == "a" else "a"
    # cached 768 > missed 256 on `other`: exploit it even though it is not the least loaded
    d = p.pick(q, [cand("a", 48 if other == "a" else 0), cand("b", 48 if other == "b" else 0)])
    assert (d.worker_id, d.reason) == (other, "exploit")
    # cached 256 < missed 768: explore -> the least windowed load; both have one request now
    now[0] += 1.0
    d = p.pick(query(1024, 10), [cand("a", 16), cand("b")])
    assert d.reason == "explore"
    # after the 3-minute window the history is gone
    now[0] += 200.0
    assert p.pick(q, [cand("a"), cand("b")]).score == 0


def feed(learner: StepCostLearner, worker: str, reports: int, seed: int) -> None:
    import random

    rng = random.Random(seed)
    c = dict(busy_s=0.0, steps=0, prefill_tokens=0, prefill_pairs=0, decode_tokens=0, decode_context_tokens=0)
    for _ in range(reports):
        d = dict(steps=rng.randint(50, 500), prefill_tokens=rng.randint(0, 50_000), prefill_pairs=rng.randint(0, 10**9),
                 decode_tokens=rng.randint(0, 20_000), decode_context_tokens=rng.randint(0, 10**8))
        for k, v in d.items():
            c[k] += v
        c["busy_s"] += (TRUE["step_s"] * d["steps"] + TRUE["prefill_token_s"] * d["prefill_tokens"]
                        + TRUE["prefill_pair_s"] * d["prefill_pairs"] + TRUE["decode_seq_s"] * d["decode_tokens"]
                        + TRUE["decode_context_token_s"] * d["decode_context_tokens"])
        load = Load(**c)
        learner.observe(worker, load)
        learner.observe(worker, load)  # a repeat (the same heartbeat seen twice) adds nothing


def test_learner_recovers_the_step_cost_from_counter_deltas():
    learner = StepCostLearner(min_reports=8)
    learner.observe("w0", Load())  # no counters: an older worker
    feed(learner, "w0", 5, seed=1)
    assert learner.estimate() is None  # 4 deltas so far
    feed(learner, "w1", 20, seed=2)
    est = learner.estimate()
    assert est is not None
    for k, v in TRUE.items():
        assert getattr(est, k) == pytest.approx(v, rel=1e-6)


def test_kv_aware_predicts_ttft_from_learned_costs_and_weighs_the_decodes_it_delays():
    p = KvAwarePolicy(PolicyConfig(seed=0, decode_harm_weight=0.0))
    feed(p.cost, "w9", 12, seed=3)
    m = p.cost.estimate()
    q = query(4096)
    # a holds 3/4 of the prompt but has 16k tokens queued; b is idle with nothing cached
    a = cand("a", 192, queued_prefill_tokens=16_384, num_running=8, max_num_batched_tokens=8192,
             num_total_blocks=1000, num_free_blocks=500)
    b = cand("b", 0, max_num_batched_tokens=8192, num_total_blocks=1000, num_free_blocks=1000)
    ta, own_a = predicted_ttft(m, q, a)
    tb, own_b = predicted_ttft(m, q, b)
    u = 1024
    assert own_a == pytest.approx(TRUE["prefill_token_s"] * u + TRUE["prefill_pair_s"] * (u * 3072 + u * (u + 1) / 2)
                                  + TRUE["step_s"] + TRUE["decode_seq_s"] * 8
                                  + TRUE["decode_context_token_s"] * 500 * BS, rel=1e-6)
    assert ta > tb  # 16k queued tokens outweigh 3k cached ones
    assert p.pick(q, [a, b]).worker_id == "b"
    # without the queue the holder wins on its cache
    a2 = cand("a", 192, num_running=8, max_num_batched_tokens=8192, num_total_blocks=1000, num_free_blocks=500)
    assert p.pick(q, [a2, b]).worker_id == "a"
    # and weighing the 8 decodes its prefill would delay sends it to the idle worker again
    harm = KvAwarePolicy(PolicyConfig(seed=0, decode_harm_weight=1.0))
    harm.cost = p.cost
    assert harm.pick(q, [a2, b]).worker_id == "b"
