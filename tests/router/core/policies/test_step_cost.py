"""kv-aware's step-cost learner per worker, per class and pooled (router/core/policies/cost.py), and what
the per-worker fit changes in a pick."""

from __future__ import annotations

import hashlib
import random

import pytest

from kvmesh.contract.types import Load
from kvmesh.model_worker.simulated.step_time import LinearCost
from kvmesh.router.core.policies.base import Candidate, PolicyConfig, RouteQuery
from kvmesh.router.core.policies.cost import StepCostLearner
from kvmesh.router.core.policies.kv_aware import KvAwarePolicy

FAST = LinearCost(step_overhead_s=0.006, prefill_token_s=40e-6, attn_pair_s=1e-9, decode_seq_s=50e-6,
                  decode_kv_token_s=40e-9)
SLOW = LinearCost(step_overhead_s=0.009, prefill_token_s=100e-6, attn_pair_s=3e-9, decode_seq_s=80e-6,
                  decode_kv_token_s=65e-9)
FIELDS = ("step_s", "prefill_token_s", "prefill_pair_s", "decode_seq_s", "decode_context_token_s")


def coefficients(c: LinearCost) -> tuple[float, ...]:
    return c.step_overhead_s, c.prefill_token_s, c.attn_pair_s, c.decode_seq_s, c.decode_kv_token_s


def feed(learner: StepCostLearner, worker: str, cost: LinearCost, reports: int, seed: int) -> None:
    """``reports`` cumulative reports of a worker whose steps take ``cost``'s time exactly."""
    rng = random.Random(seed)
    c = dict(busy_s=0.0, steps=0, prefill_tokens=0, prefill_pairs=0, decode_tokens=0, decode_context_tokens=0)
    for _ in range(reports):
        d = dict(steps=rng.randint(50, 500), prefill_tokens=rng.randint(0, 50_000), prefill_pairs=rng.randint(0, 10**9),
                 decode_tokens=rng.randint(0, 20_000), decode_context_tokens=rng.randint(0, 10**8))
        for k, v in d.items():
            c[k] += v
        c["busy_s"] += sum(x * y for x, y in zip(coefficients(cost), (d["steps"], d["prefill_tokens"],
                                                                      d["prefill_pairs"], d["decode_tokens"],
                                                                      d["decode_context_tokens"]), strict=True))
        learner.observe(worker, Load(**c))


def fitted(learner: StepCostLearner, worker: str | None) -> tuple[float, ...]:
    est = learner.estimate(worker)
    assert est is not None
    return tuple(getattr(est, f) for f in FIELDS)


def test_each_worker_gets_its_own_fit_and_the_pooled_one_answers_until_then():
    learner = StepCostLearner(min_reports=8)
    feed(learner, "h100-like", FAST, 6, seed=1)
    assert learner.estimate("h100-like") is None  # 5 deltas: nothing yet, for any worker
    feed(learner, "a100-like", SLOW, 20, seed=2)
    # the first worker has 5 deltas of its own: the pooled fit answers for it
    assert fitted(learner, "h100-like") == fitted(learner, None)
    assert fitted(learner, "a100-like") == pytest.approx(coefficients(SLOW), rel=1e-6)
    feed(learner, "h100-like", FAST, 10, seed=3)  # a new series: its first report is a baseline
    assert fitted(learner, "h100-like") == pytest.approx(coefficients(FAST), rel=1e-6)
    assert fitted(learner, "a100-like") == pytest.approx(coefficients(SLOW), rel=1e-6)
    # the pooled fit blends the two (and fits neither)
    pooled = fitted(learner, None)
    assert all(f < p < s for f, p, s in zip(coefficients(FAST)[1:2], pooled[1:2], coefficients(SLOW)[1:2], strict=True))
    assert fitted(learner, "never-reported") == pooled


def test_pooled_and_class_fits_share_reports():
    pooled = StepCostLearner(min_reports=8, group=None)
    feed(pooled, "a", FAST, 12, seed=1)
    feed(pooled, "b", SLOW, 12, seed=2)
    assert fitted(pooled, "a") == fitted(pooled, "b") == fitted(pooled, None)
    by_class = StepCostLearner(min_reports=8, group=lambda w: w.split("-")[0])
    feed(by_class, "fast-0", FAST, 6, seed=1)
    feed(by_class, "fast-1", FAST, 6, seed=2)  # 5 + 5 deltas: the class has enough, neither worker alone
    feed(by_class, "slow-0", SLOW, 12, seed=3)
    assert fitted(by_class, "fast-0") == fitted(by_class, "fast-1") == pytest.approx(coefficients(FAST), rel=1e-6)
    assert fitted(by_class, "slow-0") == pytest.approx(coefficients(SLOW), rel=1e-6)


def test_kv_aware_sends_a_cold_prefill_to_the_worker_its_own_reports_show_faster():
    # a holds 1 of 256 blocks; both idle. Pooled, the two cost the same per token and a's hit wins;
    # per worker, b's reports show it 2.5x faster per prefill token, which beats one block.
    chain = [hashlib.sha256(f"b{i}".encode()).digest()[:16] for i in range(256)]
    q = RouteQuery(4096, 16, chain, True, 64)
    cands = [Candidate("a", "a:1", 1, Load(max_num_batched_tokens=8192)),
             Candidate("b", "b:1", 0, Load(max_num_batched_tokens=8192))]
    picks = {}
    for fit in ("worker", "pooled"):
        p = KvAwarePolicy(PolicyConfig(seed=0, step_cost_fit=fit))
        feed(p.cost, "a", SLOW, 12, seed=1)
        feed(p.cost, "b", FAST, 12, seed=2)
        picks[fit] = p.pick(q, cands).worker_id
    assert picks == {"worker": "b", "pooled": "a"}
    with pytest.raises(ValueError, match="--step-cost-fit"):
        PolicyConfig(step_cost_fit="class").check()
