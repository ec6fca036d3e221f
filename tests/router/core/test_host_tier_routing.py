"""Tier-aware routing: the host link learned from the workers' reports, kv-aware pricing a host hit by
its transfer against the prefill it saves, the peers' tier credits as their sources give them, and
the candidates' host continuation from a Lookup (docs/router.md, "Host-tier hits")."""

from __future__ import annotations

import hashlib
import random

import pytest

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.index_protocol import WorkerMatch
from kvmesh.contract.types import Load, ModelSpec
from kvmesh.router.core.decide import plan_now
from kvmesh.router.core.policies import make_policy
from kvmesh.router.core.policies.base import Candidate, PolicyConfig, RouteQuery, uncached_tokens
from kvmesh.router.core.policies.cost import StepCostLearner
from kvmesh.router.core.policies.kv_aware import KvAwarePolicy, predicted_ttft
from kvmesh.router.core.routing import RoutingCore
from kvmesh.router.core.upstream import WorkerEndpoint

BS = 16
TRUE = dict(step_s=0.006, prefill_token_s=60e-6, prefill_pair_s=1.3e-9, decode_seq_s=50e-6, decode_context_token_s=40e-9)


def query(prompt_len: int) -> RouteQuery:
    chain = [hashlib.sha256(f"b{i}".encode()).digest()[:16] for i in range(prompt_len // BS)]
    return RouteQuery(prompt_len, BS, chain, True, 100)


def feed(learner: StepCostLearner, worker: str, reports: int, seed: int, load_s_per_block: float = 0.0) -> None:
    """Cumulative reports of a worker whose steps take TRUE's time plus, with ``load_s_per_block``,
    the loads of some host blocks (part of its busy seconds, as a worker reports them)."""
    rng = random.Random(seed)
    c = dict(busy_s=0.0, steps=0, prefill_tokens=0, prefill_pairs=0, decode_tokens=0, decode_context_tokens=0,
             host_loaded_blocks=0, host_load_s=0.0)
    for _ in range(reports):
        d = dict(steps=rng.randint(50, 500), prefill_tokens=rng.randint(0, 50_000), prefill_pairs=rng.randint(0, 10**9),
                 decode_tokens=rng.randint(0, 20_000), decode_context_tokens=rng.randint(0, 10**8))
        loaded = rng.randint(0, 300) if load_s_per_block else 0
        for k, v in d.items():
            c[k] += v
        c["host_loaded_blocks"] += loaded
        c["host_load_s"] += loaded * load_s_per_block
        c["busy_s"] += (TRUE["step_s"] * d["steps"] + TRUE["prefill_token_s"] * d["prefill_tokens"]
                        + TRUE["prefill_pair_s"] * d["prefill_pairs"] + TRUE["decode_seq_s"] * d["decode_tokens"]
                        + TRUE["decode_context_token_s"] * d["decode_context_tokens"] + loaded * load_s_per_block)
        learner.observe(worker, Load(**c))


def test_the_link_is_learned_per_worker_from_its_load_counters_and_loads_do_not_bias_the_step_fit():
    learner = StepCostLearner(min_reports=8)
    feed(learner, "no-tier", 12, seed=1)
    assert learner.load_s_per_block() is None and learner.load_s_per_block("no-tier") is None
    feed(learner, "pcie", 12, seed=2, load_s_per_block=40e-6)
    feed(learner, "c2c", 3, seed=3, load_s_per_block=6e-6)  # 2 deltas: not enough of its own yet
    assert learner.load_s_per_block("pcie") == pytest.approx(40e-6, rel=1e-9)
    pooled = learner.load_s_per_block()
    assert 6e-6 < pooled < 40e-6 and learner.load_s_per_block("c2c") == pooled
    feed(learner, "c2c", 6, seed=4, load_s_per_block=6e-6)  # a new series: its first report a baseline
    assert learner.load_s_per_block("c2c") == pytest.approx(6e-6, rel=1e-9)
    assert learner.load_s_per_block("no-tier") == learner.load_s_per_block()  # never loaded: the pooled one
    # the busy seconds of those loads are not step time: the step fit still recovers TRUE exactly
    for wid in ("pcie", "c2c", None):
        est = learner.estimate(wid)
        assert est is not None
        for k, v in TRUE.items():
            assert getattr(est, k) == pytest.approx(v, rel=1e-6), (wid, k)


def cand(wid: str, matched: int = 0, host: int = 0, **load) -> Candidate:
    return Candidate(wid, f"{wid}:1", matched, Load(max_num_batched_tokens=8192, num_total_blocks=4000,
                                                    num_free_blocks=4000, **load), host_blocks=host)


def test_kv_aware_prices_a_host_hit_by_its_transfer_against_the_prefill_it_saves():
    q = query(4096)  # 256 blocks
    # a: the whole prompt in its host tier, 4 requests decoding; b: idle, nothing cached
    a, b = cand("a", 0, 256, num_running=4), cand("b")
    p = KvAwarePolicy(PolicyConfig(seed=0))
    feed(p.cost, "w9", 12, seed=5)  # a step cost, and no load reported yet: a host block is one to recompute
    m = p.cost.estimate()
    assert predicted_ttft(m, q, a) == predicted_ttft(m, q, cand("a", 0, 0, num_running=4))
    assert p.pick(q, [a, b]).worker_id == "b"
    # a link of 40 us per block (a 2 MiB block over PCIe Gen5): 256 loads, ~10 ms, against ~0.3 s of prefill
    feed(p.cost, "a", 12, seed=6, load_s_per_block=40e-6)
    link = p.cost.load_s_per_block("a")
    ttft, own = predicted_ttft(m, q, a, load_s_per_block=link)
    per_step = TRUE["step_s"] + TRUE["decode_seq_s"] * 4
    assert own == pytest.approx(256 * 40e-6, rel=1e-6)  # nothing to prefill: the loads alone
    assert ttft == pytest.approx(256 * 40e-6 + per_step, rel=1e-6)  # plus the step that carries them
    d = p.pick(q, [a, b])
    assert (d.worker_id, d.reason) == ("a", "prefix")
    # a link so slow that loading costs more than recomputing (50 ms a block): b again
    slow = KvAwarePolicy(PolicyConfig(seed=0))
    feed(slow.cost, "w9", 12, seed=5)
    feed(slow.cost, "a", 12, seed=6, load_s_per_block=50e-3)
    assert slow.pick(q, [a, b]).worker_id == "b"


def test_the_peers_credit_host_hits_as_their_sources_weigh_them():
    q = query(1024)  # 64 blocks
    # dynamo: overlap = device + 0.75 host. a: 0 + 0.75 * 32 = 24 blocks -> (1024 - 384) / 16 + 64 new = 104;
    # b: 20 device blocks -> (1024 - 320) / 16 + 64 = 108
    a = Candidate("a", "a:1", indexed_host_blocks=32)
    b = Candidate("b", "b:1", 20, indexed_blocks=20)
    d = make_policy("dynamo", PolicyConfig(seed=0)).pick(q, [a, b])
    assert (d.worker_id, d.reason, d.score) == ("a", "prefix", 104)
    # llm-d: a block held in the host tier scores 0.8 (llm-d-kv-cache's cpu weight). a: 0.8 * 40 / 64 = 0.5;
    # b: 30 / 64; queue and usage equal: a = 2 * 0.5 + 1 + 1
    a = Candidate("a", "a:1", indexed_host_blocks=40)
    b = Candidate("b", "b:1", 30, indexed_blocks=30)
    d = make_policy("llm-d", PolicyConfig(seed=0)).pick(q, [a, b])
    assert (d.worker_id, d.score) == ("a", 3000)
    # lmetric is tier-blind: a's host blocks count as uncached, b's device blocks do not
    a = Candidate("a", "a:1", host_blocks=64, load=Load(num_running=1))
    b = Candidate("b", "b:1", 8, load=Load(num_running=1))
    assert make_policy("lmetric", PolicyConfig(seed=0)).pick(q, [a, b]).worker_id == "b"


def test_a_lookups_host_continuation_reaches_the_candidates_past_a_speculative_match():
    spec = ModelSpec("m", 4, "sha256_128")
    prompt = list(range(1, 33))  # 8 blocks of 4
    chain = BlockHasher("m", 4).hash_prompt(prompt)

    class Index:
        def lookup(self, model_id, hashes):
            return [WorkerMatch("w1", "a:1", 2, Load(), 4, host_blocks=5), WorkerMatch("w2", "a:2", 3, Load(), 4)]

    core = RoutingCore(make_policy("dynamo", PolicyConfig(seed=0)), speculative_ttl_s=2.0)
    plan = plan_now(core, spec, prompt, [WorkerEndpoint("w1", "a:1"), WorkerEndpoint("w2", "a:2")], Index())
    got = {c.worker_id: (c.matched_blocks, c.host_blocks, c.indexed_blocks, c.indexed_host_blocks)
           for c in plan.candidates}
    assert got == {"w1": (2, 5, 2, 5), "w2": (3, 0, 3, 0)}
    assert uncached_tokens(plan.candidate("w1"), plan.query) == 32 - 7 * 4
    # w1 served this prompt a moment ago: the speculative map says it holds all 8 blocks on its device
    core.speculative.record(chain, "w1")
    plan = plan_now(core, spec, prompt, [WorkerEndpoint("w1", "a:1"), WorkerEndpoint("w2", "a:2")], Index())
    w1 = plan.candidate("w1")
    assert (w1.matched_blocks, w1.host_blocks, w1.indexed_blocks, w1.indexed_host_blocks) == (8, 0, 2, 5)
