"""Prefill/decode disaggregation in the simulator (kvmesh/sim/pd.py): the three modes and the peers' deciders
on the production holds, imports and decision; the transfer priced by bytes over the link; the ITL SLO."""

from __future__ import annotations

import pytest

from kvmesh.contract.types import Load
from kvmesh.router.core.policies.base import Candidate, RouteQuery
from kvmesh.sim.config import SimConfig
from kvmesh.sim.pd import DynamoDecider, LlmdDecider, parse_pd, parse_policy, worker_roles
from kvmesh.sim.run import Sim
from kvmesh.sim.workload import make_workload

BASE = dict(pd="1:3", slo_itl_s=0.2, seed=2)


def run(policy: str, rate: float = 1.0, n: int = 80, workload: str = "long-beside-chat", **kw) -> dict:
    return Sim(make_workload(workload, n, seed=2), SimConfig(**(BASE | kw))).run(policy, rate)


def test_modes_split_what_they_say_and_send_only_uncached_bytes():
    agg, always, auto = run("kv-aware"), run("kv-aware+always"), run("kv-aware+auto")
    for r in (agg, always, auto):
        assert r["completed"] == 80 and r["failed"] == 0
    assert agg["pd"]["split"] == 0 and not agg["pd"]["decisions"]
    assert always["pd"]["split"] == 80 and always["pd"]["decisions"] == {"mode": 80}
    # the split requests' bytes never exceed the KV of their uncached blocks (only what the decode worker lacks)
    assert 0 < always["pd"]["bytes_per_uncached_byte"] <= 1.0
    assert sum(auto["pd"]["decisions"].values()) == 80
    # pulled blocks are no cache hit: no prompt here is shared
    assert always["hit_rate"] == 0.0
    # the chats beside long documents: splitting takes the long prefills off the decode workers
    assert always["max_itl_p99_s"] < agg["max_itl_p99_s"]


def test_a_faster_link_shortens_the_transfers():
    rdma, nvlink = run("kv-aware+always", pd_link="rdma"), run("kv-aware+always", pd_link="nvlink")
    assert rdma["pd"]["bytes_sent"] == nvlink["pd"]["bytes_sent"] > 0
    # every split request sent blocks (no prompt is shared): one latency each, plus bytes over the rate
    for r, rate in ((rdma, 50e9), (nvlink, 450e9)):
        assert r["pd"]["transfer_s"] == pytest.approx(r["pd"]["split"] * 50e-6 + r["pd"]["bytes_sent"] / rate, rel=1e-4)


def test_the_peers_deciders_follow_their_sources():
    q = RouteQuery(prompt_len=3000, block_size=64, block_hashes=[b"x" * 16] * 46)
    decode = Candidate("d", "a", indexed_blocks=10)
    prefills = [Candidate("p1", "a", load=Load(num_waiting=1)), Candidate("p0", "a", load=Load(num_waiting=1))]
    # llm-d: tokens past the decode pod's prefix match against nonCachedTokens (0 = always); queue-scorer pick
    assert LlmdDecider(0).decide(q, decode, prefills).prefill_worker == "p0"
    assert LlmdDecider(2361).decide(q, decode, prefills).prefill_worker is None  # 3000 - 640 = 2360 < 2361
    assert LlmdDecider(2360).decide(q, decode, prefills).prefill_worker == "p0"
    # Dynamo: prompt * (1 - hit rate) > 1000 and fewer than 2 requests queued for prefill
    assert DynamoDecider().decide(q, decode, prefills).reason == "prefill_busy"
    assert DynamoDecider().decide(q, decode, prefills[:1]).prefill_worker == "p1"
    assert DynamoDecider(max_local_prefill_length=2360).decide(q, decode, prefills[:1]).reason == "short"


def test_policy_names_fleet_and_roles():
    assert parse_policy("kv-aware") == ("kv-aware", "")
    assert parse_policy("kv-aware+auto") == ("kv-aware", "auto")
    assert parse_policy("llm-d+pd") == ("llm-d", "pd")
    for bad in ("kv-aware+pd", "llm-d+auto", "kv-aware+sometimes"):
        with pytest.raises(ValueError):
            parse_policy(bad)
    assert parse_pd("2:6") == (2, 6)
    for bad in ("2", "0:4", "a:b"):
        with pytest.raises(ValueError, match="PREFILL:DECODE"):
            parse_pd(bad)
    assert worker_roles("1:2", "auto", 3) == ["prefill", "decode", "decode"]
    assert worker_roles("1:2", "", 3) == ["both"] * 3
    assert SimConfig(pd="2:6").num_workers == 8
    with pytest.raises(ValueError, match="--pd-link"):
        SimConfig(pd="1:1", pd_link="carrier-pigeon").check()


def test_the_itl_slo_counts_against_attainment():
    loose, tight = run("kv-aware", slo_itl_s=0.0), run("kv-aware", slo_itl_s=0.001)
    assert loose["max_itl_p99_s"] > 0.001
    assert tight["slo_attainment"] < loose["slo_attainment"]
