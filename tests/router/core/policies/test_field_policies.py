"""The field's policies and the learned-cost kv-aware, each picking as its formula says on
hand-built candidates; the step-cost learner recovering known coefficients."""

from __future__ import annotations

import hashlib

import pytest

from kvmesh.contract.types import Load
from kvmesh.router.core.policies import POLICIES, make_policy
from kvmesh.router.core.policies.base import Candidate, PolicyConfig, RouteQuery
from kvmesh.router.core.policies.cost import StepCostLearner
from kvmesh.router.core.policies.kv_aware import KvAwarePolicy, predicted_ttft

BS = 16
TRUE = dict(step_s=0.006, prefill_token_s=60e-6, prefill_pair_s=1.3e-9, decode_seq_s=50e-6, decode_context_token_s=40e-9)


def query(prompt_len: int, max_tokens: int = 100) -> RouteQuery:
    chain = [hashlib.sha256(f"b{i}".encode()).digest()[:16] for i in range(prompt_len // BS)]
    return RouteQuery(prompt_len, BS, chain, True, max_tokens)


def cand(wid: str, matched: int = 0, **load) -> Candidate:
    inflight = {k: load.pop(k) for k in list(load) if k.startswith("inflight_") or k == "indexed_blocks"}
    return Candidate(wid, f"{wid}:1", matched, Load(**load), **inflight)


def test_every_policy_is_registered_and_picks_from_one_candidate():
    assert {"kv-aware", "round-robin", "least-loaded", "prefix-hash", "approx-tree", "dynamo", "llm-d", "preble",
            "lmetric", "llm-d-sticky", "llm-d-sticky-decode", "llm-d-predicted", "llm-d-lora-affinity",
            "llm-d-lora-load-state", "kv-aware-no-residency"} == set(POLICIES)
    for name in POLICIES:
        assert make_policy(name, PolicyConfig(seed=0)).pick(query(64), [cand("a")]).worker_id == "a"


def test_llmd_precise_profile_weights_2_1_1_on_the_index_and_the_workers_figures():
    q = query(1024)  # 64 blocks
    # a: index 32/64 -> 2*0.5; queue 4 (the max) -> 0; usage 0.5 -> 0.5      = 1.5
    # b: prefix 0; queue 0 (the min) -> 1; usage 0 -> 1                      = 2.0
    # c: index 64/64 -> 2; queue 2 -> 0.5; usage 0.9 -> 0.1                  = 2.6
    # a's speculative match (matched_blocks) and c's router-side view (in-flight) are not llm-d's inputs
    cands = [cand("a", 64, indexed_blocks=32, num_waiting=4, num_total_blocks=100, num_free_blocks=50),
             cand("b", num_total_blocks=100, num_free_blocks=100),
             cand("c", indexed_blocks=64, num_waiting=2, num_total_blocks=100, num_free_blocks=10,
                  inflight_waiting=40, inflight_blocks=1000)]
    p = make_policy("llm-d", PolicyConfig(seed=0))
    d = p.pick(q, cands)
    assert (d.worker_id, d.reason, d.score) == ("c", "prefix", 2600)
    # with its own scrape of c: queue 10 (the max), usage 1 -> c 2 + 0 + 0 = 2; a 1 + 0.6 + 0.5 = 2.1
    p.scraped("c", Load(num_waiting=10, num_total_blocks=100, num_free_blocks=0))
    d = p.pick(q, cands)
    assert (d.worker_id, d.score) == ("a", 2100)


def test_prefix_hash_ring_has_150_points_per_worker_and_moves_only_a_leaving_workers_keys():
    from kvmesh.router.core.policies.basic import HashRing

    assert len(HashRing(["a", "b", "c"])._owners) == 450
    workers = [cand(f"w{i}") for i in range(5)]
    p = make_policy("prefix-hash", PolicyConfig(seed=0))
    keys = [[hashlib.sha256(f"k{i}.{j}".encode()).digest()[:16] for j in range(20)] for i in range(200)]
    before = [p.pick(RouteQuery(320, BS, k), workers).worker_id for k in keys]
    assert set(before) == {f"w{i}" for i in range(5)}
    after = [p.pick(RouteQuery(320, BS, k), [w for w in workers if w.worker_id != "w3"]).worker_id for k in keys]
    moved = [i for i in range(200) if before[i] != after[i]]
    assert moved and moved == [i for i in range(200) if before[i] == "w3"]


def test_prefix_hash_key_is_the_first_256_tokens():
    p = make_policy("prefix-hash", PolicyConfig(seed=0))
    workers = [cand(f"w{i}") for i in range(8)]
    head = query(256).block_hashes  # 16 blocks of 16 tokens
    picks = set()
    for i in range(20):
        tail = [hashlib.sha256(f"t{i}.{j}".encode()).digest()[:16] for j in range(4)]
        picks.add(p.pick(RouteQuery(320, BS, [*head, *tail]), workers).worker_id)
    assert len(picks) == 1  # they differ only after token 256
    # a prompt without a full block has no key: the least loaded
    loaded = [cand(f"w{i}", inflight_requests=0 if i == 5 else 2) for i in range(8)]
    assert p.pick(RouteQuery(10, BS, []), loaded).worker_id == "w5"


def test_prefix_hash_bound_is_1_25_times_the_mean_load_plus_one():
    p = make_policy("prefix-hash", PolicyConfig(seed=0))
    q = query(320)
    ids = [f"w{i}" for i in range(4)]
    target = p.pick(q, [cand(w) for w in ids]).worker_id
    others = [w for w in ids if w != target]

    def with_loads(target_load: int, rest: tuple[int, int, int]) -> list:
        loads = dict(zip(others, rest, strict=True)) | {target: target_load}
        return [cand(w, inflight_requests=loads[w]) for w in ids]

    # total 10 over 4: bound 1.25 * 11 / 4 = 3.4375
    d = p.pick(q, with_loads(3, (3, 2, 2)))
    assert (d.worker_id, d.reason) == (target, "prefix_hash")
    d = p.pick(q, with_loads(4, (2, 2, 2)))
    assert (d.worker_id, d.reason, d.score) == (others[0], "load", 2)  # the first of the least loaded


def test_lmetric_product_of_prefill_tokens_and_batch():
    q = query(1024)
    # a: (0 + 256) * 3 running = 768; b: (1024) * 1 = 1024; c: idle -> 0 whatever its cache
    cands = [cand("a", 48, num_running=3), cand("b", num_running=1), cand("c")]
    assert make_policy("lmetric", PolicyConfig(seed=0)).pick(q, cands).worker_id == "c"
    d = make_policy("lmetric", PolicyConfig(seed=0)).pick(q, cands[:2])
    assert (d.worker_id, d.score) == ("a", 768)


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
