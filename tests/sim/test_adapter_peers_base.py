"""The adapter peers on base-model requests (router/core/policies/__init__.py, ``ADAPTER_PEERS``): they pick as
the policy they extend, so ``kvmesh simulate``'s default policies leave them out of a workload without LoRA
adapters, and keep them where adapters are."""

from __future__ import annotations

import json

import pytest

from kvmesh.router.core.policies import ADAPTER_PEERS, policy_names
from kvmesh.sim.config import SimConfig
from kvmesh.sim.run import Sim
from kvmesh.sim.workload import make_workload, multi_adapter
from tests.support.sim import simulate


def _same(a: dict, b: dict) -> dict:
    """Every field of two runs' results that differs, but the policy's name and the wall clock."""
    keys = (a.keys() | b.keys()) - {"policy", "_wall_s"}
    return {k: (a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("peer", sorted(ADAPTER_PEERS))
def test_an_adapter_peer_picks_as_the_policy_it_extends_without_adapters(peer):
    # Loaded (rate 3 on 3 workers): every pick weighs load, so a LoRA term that were not equal on every
    # worker, or a kv-aware adapter term that counted without an adapter, moves a pick (a planted
    # -0.3 x running requests in the load-state score, or 0.05 s x decoders in no-residency's, fails here).
    sim = Sim(make_workload("hot-prompt", 120, seed=1), SimConfig(workers=3, seed=1))
    ours, theirs = sim.run(peer, 3.0), sim.run(ADAPTER_PEERS[peer], 3.0)
    assert _same(ours, theirs) == {}
    assert ours["completed"] == 120


@pytest.mark.timeout(300)
def test_with_adapters_the_lora_peers_pick_otherwise():
    # The check above could pass with peers that are llm-d under another name; on adapters they are not.
    sim = Sim(multi_adapter(200, adapters=12, seed=2), SimConfig(workers=3, seed=2, max_loras=2))
    base = sim.run("llm-d", 4.0)
    for peer in ("llm-d-lora-affinity", "llm-d-lora-load-state"):
        assert _same(sim.run(peer, 4.0), base) != {}


@pytest.mark.timeout(300)
def test_the_default_policies_leave_the_adapter_peers_out_only_without_adapters(tmp_path):
    quick = ["--max-requests", "24", "--workers", "2", "--rates", "2", "--no-capacity", "--relative-rates", "",
             "--no-limits", "--no-progress"]
    out = tmp_path / "base.json"
    proc = simulate(["--workload", "hot-prompt", *quick, "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    ran = [r["policy"] for r in doc["runs"]]
    assert ran == [p for p in policy_names() if p not in ADAPTER_PEERS]
    assert sorted(doc["not_run"]) == sorted(ADAPTER_PEERS) and "not run" in proc.stderr
    # named, they run
    proc = simulate(["--workload", "hot-prompt", *quick, "--policies", "llm-d-lora-affinity", "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert [r["policy"] for r in doc["runs"]] == ["llm-d-lora-affinity"] and "not_run" not in doc
    # a workload with adapters runs every policy
    proc = simulate(["--workload", "multi-adapter", *quick, "--json", str(out)])
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    assert [r["policy"] for r in doc["runs"]] == policy_names() and "not_run" not in doc
