"""llm-d's predicted-latency peer (router/core/policies/llmd_predicted.py): the online regressor learns from the
router's own requests, the best fit packs on the least headroom that still meets the objectives, without them
the lowest prediction wins, and the ε-greedy gate keeps the high-affinity endpoints."""

from __future__ import annotations

import hashlib

import numpy as np

from kvmesh.contract.types import Load
from kvmesh.router.core.inflight import Ticket
from kvmesh.router.core.policies import make_policy
from kvmesh.router.core.policies.base import Candidate, Objectives, PolicyConfig, RouteQuery
from kvmesh.router.core.policies.latency_model import BoostedTrees, LatencyModel
from kvmesh.router.core.policies.llmd_predicted import LlmdPredictedPolicy, window_bucket

BS = 16
PROMPT = 1024  # 64 blocks


def query(prompt_len: int = PROMPT, objectives: Objectives = Objectives()) -> RouteQuery:
    chain = [hashlib.sha256(f"b{i}".encode()).digest()[:16] for i in range(prompt_len // BS)]
    return RouteQuery(prompt_len, BS, chain, True, 100, objectives)


def cand(wid: str, indexed: int = 0, waiting: int = 0, running: int = 0) -> Candidate:
    load = Load(num_running=running, num_waiting=waiting, num_free_blocks=900, num_total_blocks=1000)
    return Candidate(wid, f"{wid}:1", indexed, load=load, indexed_blocks=indexed)


def synthetic(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    x = rng.random((n, 6)) * [1.0, 8000, 20, 64, 1.0, 50_000]
    y = 0.05 + 0.4 * x[:, 0] + 2e-5 * x[:, 1] * (1 - x[:, 4]) + 0.03 * x[:, 2] + 1e-5 * x[:, 5]
    return x, y


def test_the_predictor_learns_a_synthetic_relation():
    rng = np.random.default_rng(0)
    model = LatencyModel(window_bucket, per_bucket=64, min_samples=32, refit_every=32)
    x_test, y_test = synthetic(rng, 300)
    before = np.mean(np.abs(model.predict(x_test) - y_test) / y_test)
    for row, y in zip(*synthetic(rng, 640), strict=True):
        model.add(row, y)
    assert model.ready and model.fits == 20
    after = np.mean(np.abs(model.predict(x_test) - y_test) / y_test)
    constant = np.mean(np.abs(y_test.mean() - y_test) / y_test)
    assert before > 0.9  # unfitted: predicts 0
    assert after < 0.25 * constant, (after, constant)


def test_boosted_trees_split_on_the_feature_that_matters():
    rng = np.random.default_rng(1)
    x = rng.random((400, 3))
    y = np.where(x[:, 2] > 0.5, 1.0, 0.0)
    pred = BoostedTrees(rounds=20).fit(x, y).predict(np.array([[0.9, 0.9, 0.1], [0.1, 0.1, 0.9]]))
    assert pred[0] < 0.1 and pred[1] > 0.9


def test_best_fit_picks_the_least_headroom_that_meets_both_objectives():
    p = LlmdPredictedPolicy(PolicyConfig(seed=0))
    ttft = np.array([0.2, 0.8, 1.5, 0.9])
    tpot = np.array([0.01, 0.01, 0.01, 0.06])  # the last meets TTFT, misses TPOT
    # meets: 0 (headroom 0.8*0.8 + 0.2*0.8) and 1 (0.8*0.2 + 0.2*0.8): the tighter, not the fastest
    assert p.choose(ttft, tpot, Objectives(1.0, 0.05)) == 1
    # only TTFT given: 3 (headroom 0.1) is now the best fit
    assert p.choose(ttft, tpot, Objectives(1.0, 0.0)) == 3


def test_when_none_meets_the_objectives_the_least_violation_wins():
    p = LlmdPredictedPolicy(PolicyConfig(seed=0))
    ttft = np.array([2.0, 1.2, 1.1])
    tpot = np.array([0.01, 0.2, 0.05])  # 1: 0.8*0.2 + 0.2*3 = 0.76; 2: 0.8*0.1 + 0 = 0.08
    assert p.choose(ttft, tpot, Objectives(1.0, 0.05)) == 2


def test_without_objectives_the_lowest_prediction_wins():
    p = LlmdPredictedPolicy(PolicyConfig(seed=0))
    assert p.choose(np.array([0.9, 0.3, 0.5]), np.array([0.02, 0.02, 0.02]), Objectives()) == 1


def test_the_gate_keeps_the_high_affinity_endpoints_but_explores_with_probability_epsilon():
    p = LlmdPredictedPolicy(PolicyConfig(seed=3))
    cands = [cand("warm", indexed=64), cand("cold"), cand("edge", indexed=51)]  # hits 1.0, 0, 0.797
    kept = [p._gate(query(), cands) for _ in range(2000)]
    warm_only = sum(1 for k, why in kept if [c.worker_id for c in k] == ["warm"] and why == "prefix")
    assert 1940 <= warm_only < 2000  # ε = 0.01: about 20 explore
    assert all(len(k) == 3 for k, why in kept if why == "load")
    no_warm = [cand("a", indexed=10), cand("b")]
    assert [c.worker_id for c in p._gate(query(), no_warm)[0]] == ["a", "b"]


def test_it_learns_from_its_own_requests_and_then_avoids_the_slow_endpoint():
    now = [0.0]
    p = make_policy("llm-d-predicted", PolicyConfig(seed=0, clock=lambda: now[0]))
    fast, slow = cand("fast", running=2), cand("slow", waiting=12, running=40)
    for serial in range(1, 201):
        c = fast if serial % 2 else slow
        t = Ticket(c.worker_id, PROMPT, serial=serial)
        p.started(t, query(), c)
        now[0] += 0.1 if c is fast else 1.5  # TTFT
        p.prefilled(t)
        now[0] += 99 * (0.01 if c is fast else 0.04)  # 100 tokens
        p.finished(t, 100)
    assert p.ttft.ready and p.tpot.ready
    pred = p.ttft.predict([p.features(query(), fast), p.features(query(), slow)])
    assert abs(pred[0] - 0.1) < 0.02 and abs(pred[1] - 1.5) < 0.1
    assert p.pick(query(), [slow, fast]).worker_id == "fast"
    # best fit: both meet a loose TTFT objective, the slow one with less headroom
    assert p.pick(query(objectives=Objectives(5.0, 0.1)), [fast, slow]).worker_id == "slow"
    # a request that failed before its first token teaches nothing
    n = len(p.ttft)
    p.started(Ticket("fast", PROMPT, serial=999), query(), fast)
    p.finished(Ticket("fast", PROMPT, serial=999), 0)
    assert len(p.ttft) == n
