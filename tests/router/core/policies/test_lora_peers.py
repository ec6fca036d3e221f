"""LoRA-aware routing (issue 52, docs/adapters.md): the field's scorers' tiers, and kv-aware's price of an adapter's
residency against the prefix cached under it."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from kvmesh.contract.types import AdapterLevel, AdapterResidency, Load
from kvmesh.router.core.policies.base import Candidate, PolicyConfig, RouteQuery
from kvmesh.router.core.policies.kv_aware import (
    KvAwareNoResidencyPolicy,
    KvAwarePolicy,
    adapter_wait_s,
    slot_wait,
)
from kvmesh.router.core.policies.lora import (
    LlmdLoraAffinityPolicy,
    LlmdLoraLoadStatePolicy,
    lora_affinity_score,
    lora_load_state_score,
)
from tests.support.step_cost import linear_reports

GPU, CPU, DISK = AdapterLevel.GPU, AdapterLevel.CPU, AdapterLevel.DISK
BS = 16
COST = dict(step_s=0.002, prefill_token_s=40e-6, prefill_pair_s=0.0, decode_seq_s=50e-6, decode_context_token_s=0.0)


def load(*adapters: tuple[str, AdapterLevel, int], slots: int = 4, **kw) -> Load:
    return Load(adapters=tuple(AdapterResidency(n, lv, r) for n, lv, r in adapters), max_loras=slots,
                max_num_batched_tokens=8192, **kw)


# -- llm-d's lora-affinity-scorer ----------------------------------------------------------------------------
def test_affinity_scores_an_adapter_in_flight_1():
    assert lora_affinity_score("x", load(("x", GPU, 2), ("y", DISK, 0))) == 1.0


def test_affinity_is_blind_to_an_idle_adapter_in_a_slot():
    # y sits in a GPU slot with no request: the scorer sees it as absent, exactly like z on disk
    ld = load(("x", GPU, 1), ("y", GPU, 0), ("z", DISK, 0))
    assert lora_affinity_score("y", ld) == lora_affinity_score("z", ld) == 0.8


def test_affinity_counts_both_maps_so_half_the_slots_in_flight_look_full():
    # 2 adapters in flight on 4 slots: len(active) + len(waiting) = 4, not < 4
    ld = load(("x", GPU, 1), ("w", GPU, 3), ("y", GPU, 0))
    assert lora_affinity_score("y", ld) == 0.0
    assert lora_affinity_score("y", load(("x", GPU, 1), ("y", GPU, 0))) == 0.8


# -- PR #2792's lora-load-state-scorer -----------------------------------------------------------------------
def test_load_state_tiers():
    assert lora_load_state_score("y", load(("y", GPU, 0))) == 1.0
    assert lora_load_state_score("y", load(("y", CPU, 0))) == 0.7
    assert lora_load_state_score("y", load(("a", GPU, 1), ("y", DISK, 0))) == 0.6
    full = [("a", GPU, 1), ("b", GPU, 2), ("c", GPU, 1)]
    assert lora_load_state_score("y", load(*full, ("d", GPU, 0), ("y", DISK, 0))) == 0.3
    assert lora_load_state_score("y", load(*full, ("d", GPU, 5), ("y", DISK, 0))) == 0.0
    assert lora_load_state_score("", load(*full, ("d", GPU, 0))) == 0.25


def query(adapter: str = "x", prompt: int = 4160) -> RouteQuery:
    chain = [hashlib.sha256(f"{adapter}{i}".encode()).digest()[:16] for i in range(prompt // BS)]
    return RouteQuery(prompt, BS, chain, True, 64, adapter=adapter)


def cand(wid: str, ld: Load, matched: int = 0) -> Candidate:
    return Candidate(wid, f"{wid}:1", matched, ld, indexed_blocks=matched)


def test_llmd_peers_add_their_lora_score_to_llm_ds_profile():
    a = cand("a", load(("x", GPU, 0), ("w", GPU, 1)))       # x idle in a slot
    b = cand("b", load(("x", DISK, 0), ("w", GPU, 1)))
    # the affinity scorer sees both as 0.8 (blind): a tie; the load-state scorer prefers a by 0.4
    aff = LlmdLoraAffinityPolicy(PolicyConfig(seed=0))
    s = aff.scores(query(), [a, b], [a.load, b.load])
    assert s[0] == s[1] == pytest.approx(2 * 0 + 1 + 1 + 0.8)
    st = LlmdLoraLoadStatePolicy(PolicyConfig(seed=0))
    s = st.scores(query(), [a, b], [a.load, b.load])
    assert s == [pytest.approx(3.0), pytest.approx(2.6)]
    assert st.pick(query(), [a, b]).worker_id == "a"


# -- kv-aware ------------------------------------------------------------------------------------------------
def learned(cls: type[KvAwarePolicy] = KvAwarePolicy) -> KvAwarePolicy:
    p = cls(PolicyConfig(seed=0))
    for s, w in enumerate(("a", "b", "c", "d")):
        for ld in linear_reports(COST, 12, s):
            p.cost.observe(w, ld)
    assert p.cost.learned
    return p


def test_kv_aware_prefers_the_adapter_in_a_slot_over_a_disk_load_at_equal_prefix_and_load():
    a, b = cand("a", load(("x", DISK, 0))), cand("b", load(("x", GPU, 0)))
    p = learned()
    sa, sb = p.scores(query(), [a, b])
    assert sa - sb == pytest.approx(0.065 * (1 + p.config.work_weight), rel=1e-6)  # the load, in ttft and in work
    assert p.pick(query(), [a, b]).worker_id == "b"
    blind = learned(KvAwareNoResidencyPolicy)
    sa, sb = blind.scores(query(), [a, b])
    assert sa == pytest.approx(sb, rel=1e-6)  # the same up to the two workers' fits


def test_kv_aware_prefers_a_long_prefix_under_the_adapter_over_a_slot_when_recompute_costs_more():
    # a holds 256 of 260 blocks under x but must read x from disk (65 ms); b has x in a slot and recomputes
    # 4,160 tokens (40 us each: 166 ms)
    a, b = cand("a", load(("x", DISK, 0)), matched=256), cand("b", load(("x", GPU, 0)))
    assert learned().pick(query(), [a, b]).worker_id == "a"
    # a short prefix (4 blocks: 2.6 ms of recompute) does not pay for the load
    a = cand("a", load(("x", DISK, 0)), matched=4)
    assert learned().pick(query(), [a, b]).worker_id == "b"


def test_kv_aware_adds_the_wait_for_a_slot_when_every_slot_serves_another_adapter():
    from kvmesh.router.core.policies.cost import StepCost
    m = StepCost(step_s=0.002, prefill_token_s=40e-6, prefill_pair_s=0.0, decode_seq_s=50e-6,
                 decode_context_token_s=0.0, pairs_per_prefill_token=0.0)
    busy = [("a", GPU, 1), ("b", GPU, 3), ("c", GPU, 2), ("d", GPU, 4)]
    c = cand("w", load(*busy, ("x", CPU, 0), num_running=10))
    per_step = 0.002 + 50e-6 * 10
    assert adapter_wait_s(m, query(), c, 0.0034, 0.065, 200.0) == pytest.approx(0.0034 + per_step * 200 * 1 / 2)
    free = cand("w", load(*busy[:3], ("x", CPU, 0), num_running=10))
    assert adapter_wait_s(m, query(), free, 0.0034, 0.065, 200.0) == pytest.approx(0.0034)
    assert adapter_wait_s(m, query(), cand("w", load(*busy, ("x", GPU, 0))), 0.0034, 0.065, 200.0) == 0.0
    assert adapter_wait_s(m, query(""), c, 0.0034, 0.065, 200.0) == 0.0
    # a fifth adapter with requests waits for a slot ahead of it: two drains, the fewest requests first (1, then 2)
    queued = cand("w", load(*busy, ("e", DISK, 2), ("x", CPU, 0), num_running=10))
    assert adapter_wait_s(m, query(), queued, 0.0034, 0.065, 200.0) == pytest.approx(
        0.0034 + per_step * 200 * (1 / 2 + 2 / 3))


def test_slot_wait_marks_where_the_adapter_would_wait_for_a_slot():
    busy = [("a", GPU, 1), ("b", GPU, 3), ("c", GPU, 2), ("d", GPU, 4)]
    assert slot_wait(query(), cand("w", load(*busy, ("x", DISK, 0))))
    assert not slot_wait(query(), cand("w", load(*busy[:3], ("x", DISK, 0))))
    assert not slot_wait(query(), cand("w", load(*busy[:3], ("x", GPU, 0))))
    assert not slot_wait(query(""), cand("w", load(*busy, ("x", DISK, 0))))


def test_kv_aware_learns_the_adapter_loads_from_the_load_reports_and_they_do_not_bias_the_step_fit():
    """Workers report their slot loads (count, seconds; part of busy): kv-aware prices a disk load at what the
    reports say, per worker once it has its own, not the configured 65 ms."""
    p = learned()
    disk_s, cpu_s = 0.5, 0.02
    for i in range(1, 5):  # worker "a": i disk loads and 2i CPU copies more per report, inside its busy seconds
        more = linear_reports(COST, 12 + i, 9)[-1]
        p.cost.observe("a", replace(more, busy_s=more.busy_s + i * (disk_s + 2 * cpu_s), adapter_disk_loads=i,
                                    adapter_disk_load_s=i * disk_s, adapter_cpu_loads=2 * i,
                                    adapter_cpu_load_s=2 * i * cpu_s))
    assert p.cost.load_s("adapter_disk", "a") == pytest.approx(disk_s)
    assert p.cost.load_s("adapter_cpu") == pytest.approx(cpu_s) and p.cost.load_s("adapter_disk", "b") == pytest.approx(disk_s)
    a, b = cand("a", load(("x", DISK, 0))), cand("b", load(("x", GPU, 0)))
    sa, sb = p.scores(query(), [a, b])
    assert sa - sb == pytest.approx(disk_s * (1 + p.config.work_weight), rel=1e-3)  # not 0.065: learned
    est = p.cost.estimate("a")
    assert est is not None and est.step_s == pytest.approx(COST["step_s"], rel=1e-6)  # loads are not step time
