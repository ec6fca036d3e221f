"""The references beside the policies: the oracle when the working set exceeds the fleet's KV, the
information limit (exact state, exact cost, no delays; simulator only) and the work bound."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from kvmesh.model_worker.simulated.step_time import GPUS, Roofline
from kvmesh.router.core.policies import POLICIES
from kvmesh.router.core.policies.base import RouteQuery
from kvmesh.sim.config import SimConfig
from kvmesh.sim.information_limit import INFORMATION_LIMIT, ExactView
from kvmesh.sim.mesh import Mesh
from kvmesh.sim.oracle import lru_hit_rate
from kvmesh.sim.run import Sim, chains_for, oracle_hit_rate, sim_model_dir, sweep
from kvmesh.sim.work_bound import work_bound
from kvmesh.sim.workload import SimRequest, Workload, shared_prefix
from tests.support.sim import simulate


def recurring_prompts(n: int = 150, distinct: int = 40, prompt_len: int = 2048, seed: int = 0) -> Workload:
    """``n`` requests, each one of ``distinct`` 2k-token prompts drawn at random: 1,280 distinct
    64-token blocks in all, recurring at random distances."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        k = rng.randrange(distinct)
        reqs.append(SimRequest(i, i * 0.5, prompt_len, 8, ((k, prompt_len),)))
    return Workload("recurring", reqs)


@pytest.mark.parametrize(("fleet", "num_blocks", "usable"), [
    ("2", 300, 2 * 299),  # two pools of 300 blocks, each less its null block
    ("1xH100,1xA100", 300, 2 * 299),
])
def test_the_oracle_is_the_bounded_lru_when_distinct_blocks_exceed_the_fleet(fleet, num_blocks, usable):
    w = recurring_prompts()
    cfg = SimConfig(workers=fleet, num_blocks=num_blocks)
    prompts = [(r.prompt_len, chain) for r, chain in zip(w.requests, chains_for(w, cfg.block_size), strict=True)]
    distinct = len({b for _, chain in prompts for b in chain})
    assert distinct == 32 * len({r.segments for r in w.requests}) > 2 * usable
    bounded = lru_hit_rate(prompts, usable, cfg.block_size)
    unbounded = lru_hit_rate(prompts, distinct, cfg.block_size)
    assert oracle_hit_rate(w, cfg) == bounded
    assert 0 < bounded < unbounded - 0.2  # an infinite cache would hit every recurrence


def test_the_oracle_of_a_heterogeneous_fleet_counts_each_gpus_pool():
    # no --num-blocks: each worker holds what its GPU holds; an H200 holds about twice an H100's
    w = recurring_prompts(n=1200, distinct=800, prompt_len=4096)
    cfg = SimConfig(workers="1xH100,1xH200")
    usable = (GPUS["H100"].kv_tokens() // 64) + (GPUS["H200"].kv_tokens() // 64)
    prompts = [(r.prompt_len, chain) for r, chain in zip(w.requests, chains_for(w, cfg.block_size), strict=True)]
    assert 2 * usable < 800 * 64
    assert oracle_hit_rate(w, cfg) == lru_hit_rate(prompts, usable, 64)
    assert oracle_hit_rate(w, cfg) < lru_hit_rate(prompts, 800 * 64, 64) - 0.1
    assert oracle_hit_rate(w, SimConfig(workers="2xH100")) < oracle_hit_rate(w, cfg)


def test_the_information_limit_is_a_simulator_reference_with_no_delays():
    assert INFORMATION_LIMIT not in POLICIES  # no router can be configured with it
    cfg = Sim(shared_prefix(num_requests=4), SimConfig(workers=2)).config(INFORMATION_LIMIT, 2.0)
    assert (cfg.policy, cfg.lookup_latency_s, cfg.network_s, cfg.event_delay_s, cfg.rate) == ("kv-aware", 0, 0, 0, 2.0)


def test_the_exact_view_walks_the_worker_queue_on_its_own_step_time():
    # one 4,096-token prompt served on worker 1 of an H100 + A100 fleet; then the same prompt again
    w = Workload("one", [SimRequest(0, 0.0, 4096, 4, ((7, 4096),))])
    cfg = SimConfig(workers="1xH100,1xA100", seed=1)
    mesh = Mesh(cfg, w, sim_model_dir(), chains_for(w, cfg.block_size))
    mesh.run()
    holder = next(x for x in mesh.workers if mesh.chains[0][0] in x.engine.kv_cache_manager.block_pool.cached_block_hash_to_block)
    other = next(x for x in mesh.workers if x is not holder)
    view = ExactView(mesh)
    q = RouteQuery(4096, 64, mesh.chains[0])
    ttft, own, decoders, waiting = view.state(holder.worker_id, q)
    hit = 4032  # every full block but the one holding the last token
    assert ttft == pytest.approx(Roofline(GPUS[holder.gpu]).step_time([(hit, 64)], []))
    assert (own, decoders, waiting) == (pytest.approx(ttft), 0, 0)  # alone in its step: all of it is its own
    cold, _, _, _ = view.state(other.worker_id, q)
    assert cold == pytest.approx(Roofline(GPUS[other.gpu]).step_time([(0, 4096)], []))
    # a request on its way to the holder counts as queued there, with its own exact hit
    view.sent(holder.worker_id, q)
    queued, own2, _, waiting2 = view.state(holder.worker_id, q)
    cost = Roofline(GPUS[holder.gpu])
    assert waiting2 == 1 and queued == pytest.approx(cost.step_time([(hit, 64), (hit, 64)], []))
    assert own2 == pytest.approx(cost.step_time([(hit, 64)], []))  # its chunk as if alone, as kv-aware counts it


def test_limits_bound_the_policies():
    w = shared_prefix(num_requests=300, groups=60, prefix_len=4096, question_len=1024, output_len=16, base_rate=4.0)
    doc = sweep(Sim(w, SimConfig(workers=4)), ["kv-aware", "round-robin"], progress=False)
    caps, limits = doc["capacity"], doc["limits"]
    assert set(limits) == {"information", "work_bound", "saturation"}
    assert limits["work_bound"] >= limits["information"] >= caps["round-robin"]
    assert limits["work_bound"] >= max(caps.values())
    assert [r["policy"] for r in doc["capacity_search"][INFORMATION_LIMIT]] == [INFORMATION_LIMIT] * len(
        doc["capacity_search"][INFORMATION_LIMIT])
    assert doc["capacity_search"][INFORMATION_LIMIT][0]["decisions"] == {"exact": 300}


def test_the_work_bound_falls_with_a_slower_fleet_and_more_work():
    w = shared_prefix(num_requests=1000, groups=40, prefix_len=4096, question_len=512, output_len=128, base_rate=6.0)
    chains = chains_for(w, 64)
    h100 = work_bound(w, SimConfig(workers="4xH100"), chains)
    mixed = work_bound(w, SimConfig(workers="2xH100,2xA100"), chains)
    a100 = work_bound(w, SimConfig(workers="4xA100"), chains)
    assert h100.rate > mixed.rate > a100.rate > 0
    assert h100.saturation > mixed.saturation > a100.saturation > 0
    longer = Workload("longer", [replace(r, output_len=512) for r in w.requests])
    assert work_bound(longer, SimConfig(workers="4xH100"), chains).saturation < h100.saturation


@pytest.mark.timeout(180)
def test_a_mixed_noisy_fleet_with_limits_gives_byte_identical_json_for_a_seed(tmp_path):
    args = ["--workload", "hot-prompt", "--max-requests", "40", "--workers", "1xH100,2xA100", "--policies",
            "kv-aware,round-robin", "--relative-rates", "", "--sim-step-noise", "0.1", "--no-progress"]
    outs = []
    for n, hashseed in enumerate(("1", "2")):
        out = tmp_path / f"{n}.json"
        proc = simulate([*args, "--json", str(out)], {"PYTHONHASHSEED": hashseed})
        assert proc.returncode == 0, proc.stderr
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    doc = json.loads(outs[0])
    assert doc["settings"]["fleet"] == "1xH100,2xA100" and doc["settings"]["step_time"]["step_noise"] == 0.1
    assert doc["limits"]["information"] > 0 and set(doc["limits"]) == {"information", "work_bound", "saturation"}
    assert "information limit" in proc.stdout and "work bound" in proc.stdout
