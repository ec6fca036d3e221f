"""The simulator's LoRA adapters (issue 52, docs/adapters.md): the slots, the host cache and the load costs
(model_worker/simulated/sim_lora.py), the multi-adapter workload, and a run that serves it."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kvmesh.contract.block_hash import XXH3_128
from kvmesh.contract.types import ModelSpec
from kvmesh.model_worker.simulated.sim_lora import LoadCosts, SimLoRA, lora_bytes
from kvmesh.router.core.policies import make_policy
from kvmesh.router.core.routing import RoutingCore
from kvmesh.sim.config import MODEL_ID, SimConfig
from kvmesh.sim.run import Sim, chains_for
from kvmesh.sim.workload import ADAPTER_SYSTEM_BASE, multi_adapter

COSTS = LoadCosts()
CPU_S, DISK_S = COSTS.cpu_s, COSTS.disk_s


def test_a_rank_16_adapter_of_llama_3_8b_is_84_mb_and_its_loads_cost_what_the_links_allow():
    # per layer: 16 x (q 8192 + k 5120 + v 5120 + o 8192 + gate 18432 + up 18432 + down 18432) params, bf16
    assert lora_bytes() == 32 * 16 * (2 * 8192 + 2 * 5120 + 3 * 18432) * 2 == 83_886_080
    assert abs(CPU_S - 83_886_080 / 25e9) < 1e-12
    assert abs(DISK_S - (0.020 + 83_886_080 / 2e9 + 83_886_080 / 25e9)) < 1e-12


def test_loads_by_level_and_lru_slots_and_host_cache():
    lora = SimLoRA([f"a{i}" for i in range(5)], max_loras=2, max_cpu_loras=3)
    assert lora.residency() == {"gpu": [], "cpu": []} and lora.has("a4") and not lora.has("x")
    assert lora.load_s(["a0"]) == DISK_S                     # on disk at the start
    assert lora.load_s(["a0", "a0"]) == 0.0                # in its slot
    assert lora.load_s(["a1"]) == DISK_S
    assert lora.load_s(["a2"]) == DISK_S                     # evicts a0, the least recently used slot
    assert lora.residency() == {"gpu": ["a1", "a2"], "cpu": ["a0", "a1", "a2"]}
    assert lora.load_s(["a0"]) == CPU_S                      # from host memory; evicts a1
    assert lora.load_s(["a3"]) == DISK_S                     # evicts a2; the host cache drops a1 (LRU of 3)
    assert lora.residency() == {"gpu": ["a0", "a3"], "cpu": ["a2", "a0", "a3"]}
    assert lora.load_s(["a1"]) == DISK_S
    assert (lora.cpu_loads, lora.disk_loads) == (1, 5)
    # the load report's counters: each kind's count and its seconds
    assert (lora.cpu_load_s, lora.disk_load_s) == (pytest.approx(CPU_S), pytest.approx(5 * DISK_S))


def test_a_slot_whose_adapter_has_a_running_request_is_never_evicted():
    lora = SimLoRA(["a", "b", "c"], max_loras=2, max_cpu_loras=3)
    lora.load_s(["a"])
    lora.load_s(["b"])
    lora.load_s(["c"], running={"a"})                      # a is the least recently used, but running
    assert lora.residency()["gpu"] == ["a", "c"]


def test_disk_only_reads_every_load_from_disk():
    lora = SimLoRA(["a", "b"], max_loras=1, max_cpu_loras=0)
    assert [lora.load_s([n]) for n in ("a", "b", "a")] == [DISK_S, DISK_S, DISK_S]
    assert lora.residency() == {"gpu": ["a"], "cpu": []}


def test_a_step_of_more_adapters_than_slots_is_refused():
    with pytest.raises(ValueError, match="--max-loras is 1"):
        SimLoRA(["a", "b"], max_loras=1, max_cpu_loras=0).load_s(["a", "b"])


def test_the_workload_draws_adapters_zipf_each_with_its_own_two_system_prompts():
    w = multi_adapter(num_requests=6000, seed=3)
    assert len(w.adapters) == 64
    counts = Counter(r.adapter for r in w.requests)
    p = 1.0 / np.arange(1, 65) ** 1.1
    p /= p.sum()
    for rank in (0, 1, 9):
        assert counts[f"adapter-{rank:02d}"] / 6000 == pytest.approx(p[rank], abs=0.02)
    assert counts["adapter-00"] > counts["adapter-03"] > counts["adapter-30"]
    systems: dict[str, set[int]] = {}
    for r in w.requests:
        (seg, n), (user, m) = r.segments
        a = int(r.adapter.removeprefix("adapter-"))
        assert ADAPTER_SYSTEM_BASE + 100 * a <= seg < ADAPTER_SYSTEM_BASE + 100 * a + 2
        assert 1024 <= n <= 2048 and n % 64 == 0 and 200 <= m <= 500 and user < 0 and 100 <= r.output_len <= 300
        systems.setdefault(r.adapter, set()).add(seg)
    assert max(len(s) for s in systems.values()) == 2


def test_a_requests_chain_is_the_routers_under_its_adapter():
    w = multi_adapter(num_requests=20, seed=1)
    chains = chains_for(w, 64)
    core = RoutingCore(make_policy("round-robin"))
    spec = ModelSpec(MODEL_ID, 64, XXH3_128)
    for r, chain in zip(w.requests, chains, strict=True):
        assert chain == core.chain(spec, w.prompt(r), "", r.adapter)
    assert chains[0] != core.chain(spec, w.prompt(w.requests[0]), "", "")


def test_a_run_serves_every_request_under_its_adapter_with_loads_in_its_steps():
    w = multi_adapter(num_requests=120, seed=2)
    cfg = SimConfig(workers="2", max_loras=2, max_cpu_loras=0)
    fast = Sim(w, cfg).run("kv-aware", 1.0)
    assert fast["completed"] == 120 and fast["failed"] == 0
    # loads from disk cost time: the same run with free loads finishes its requests no later
    free = Sim(w, SimConfig(workers="2", max_loras=64, max_cpu_loras=64)).run("kv-aware", 1.0)
    assert free["completed"] == 120
    assert free["ttft_mean_s"] < fast["ttft_mean_s"]
