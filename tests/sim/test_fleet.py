"""Heterogeneous fleets (`kvmesh simulate --workers 4xH100,4xA100`): parsing, each worker on its own
GPU's roofline and KV capacity, the settings that record it, and nothing of it in what workers report."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.contract.types import Load
from kvmesh.model_worker.simulated.step_time import GPUS, Roofline, StepTimeConfig
from kvmesh.sim.config import SimConfig
from kvmesh.sim.fleet import fleet_spec, parse_fleet
from kvmesh.sim.mesh import Mesh
from kvmesh.sim.run import Sim, chains_for, settings_of, sim_model_dir
from kvmesh.sim.workload import shared_prefix


@pytest.mark.parametrize(("spec", "gpus"), [
    ("8", ["H100"] * 8),
    ("2xH100,3xA100", ["H100"] * 2 + ["A100"] * 3),
    (" 1xh200, 2 ", ["H200", "H100", "H100"]),
])
def test_a_fleet_is_groups_of_n_or_n_x_gpu_in_worker_order(spec, gpus):
    assert parse_fleet(spec, "H100") == gpus


@pytest.mark.parametrize(("spec", "message"), [
    ("0xH100", "at least 1 worker"), ("4xB200", "unknown GPU 'b200'"), ("", "at least 1 worker"),
    ("four", "NxGPU groups"), ("4xH100;4xA100", "NxGPU groups"),
])
def test_a_bad_fleet_names_the_flag(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_fleet(spec, "H100")


def test_a_plain_count_is_n_of_the_default_gpu_and_an_int_still_works():
    assert SimConfig(workers=3).worker_gpus() == ["H100"] * 3
    cfg = SimConfig(workers="2", step_time=StepTimeConfig(gpu="A100"))
    assert (cfg.worker_gpus(), cfg.num_workers) == (["A100", "A100"], 2)
    assert fleet_spec(["H100", "H100", "A100"]) == "2xH100,1xA100"
    with pytest.raises(ValueError, match="linear cost model has H100 coefficients only"):
        SimConfig(workers="1xH100,1xA100", step_time=StepTimeConfig(cost_model="linear")).check()


def test_each_worker_runs_its_gpu_and_reports_only_what_a_worker_reports():
    w = shared_prefix(num_requests=24, groups=2, prefix_len=2048, question_len=256, output_len=8, base_rate=2.0)
    cfg = SimConfig(workers="2xH100,1xA100,1xH200", seed=1)
    cfg.check()
    mesh = Mesh(cfg, w, sim_model_dir(), chains_for(w, cfg.block_size))
    records = mesh.run()
    assert all(r.finish is not None and not r.failed for r in records)
    runners = [x.runner for x in mesh.workers]
    assert [r.cost for r in runners] == [Roofline(GPUS[g]) for g in ("H100", "H100", "A100", "H200")]
    blocks = [x.engine.kv_cache_manager.num_blocks for x in mesh.workers]
    assert blocks == [6913, 6913, 6913, GPUS["H200"].kv_tokens() // 64 + 1]
    # what the index holds of a worker is its registration and its Load: counters, no hardware
    assert {f.name for f in dataclasses.fields(Load)} == {
        "num_running", "num_waiting", "num_free_blocks", "num_total_blocks", "queued_prefill_tokens", "busy_s",
        "steps", "prefill_tokens", "prefill_pairs", "decode_tokens", "decode_context_tokens", "max_num_batched_tokens",
        "admitted", "reports_admissions",  # (the request ids it admitted: the shared router view's)
        "cache_block_tokens",  # (a bridged engine's own KV block: the miss audit's, not hardware)
        "host_loaded_blocks", "host_load_s",  # (its host tier's loads: a router learns the link, not a spec)
        "num_cached_blocks",  # (blocks holding a cached prefix: what is free KV, not its size)
        "adapters", "max_loras",  # (its LoRA adapters' residency and slots: what it serves, not its GPU)
        "adapter_cpu_loads", "adapter_cpu_load_s", "adapter_disk_loads", "adapter_disk_load_s",  # (its adapter loads:
        # a router learns their cost, not a spec)
        "prefilling_tokens"}  # (its prompts without a token yet: what one router counts of its own)
    # the SLO's cold prefill is costed on the fleet's slowest GPU
    assert mesh.cold_prefill_s(8192) == Roofline(GPUS["A100"]).step_time([(0, 8192)], [])


def test_settings_record_the_fleet():
    s = settings_of(Sim(shared_prefix(num_requests=4), SimConfig(workers="2xH100,2xA100")).base)
    assert (s["workers"], s["fleet"], s["blocks_per_worker"]) == (4, "2xH100,2xA100", {"H100": 6913, "A100": 6913})
    assert s["step_time"] == {"cost_model": "roofline", "gpu": "H100", "step_noise": 0.0}
    assert s["gpus"]["A100"] == dataclasses.asdict(GPUS["A100"]) and list(s["gpus"]) == ["H100", "A100"]


def test_in_a_mixed_fleet_kv_aware_tells_the_gpus_apart_from_reports_alone():
    # its step-cost fits (per worker) see only the Load counters above; their 8k-token prefill
    # predictions still come out in the ratio of the two rooflines
    w = shared_prefix(num_requests=120, groups=12, prefix_len=2048, question_len=512, output_len=32, base_rate=8.0)
    cfg = SimConfig(workers="2xH100,2xA100", seed=1)
    mesh = Mesh(cfg, w, sim_model_dir(), chains_for(w, cfg.block_size))
    mesh.run()
    learner = mesh.routers[0].core.policy.cost

    def prefill_8k(worker) -> float:
        m = learner.estimate(worker.worker_id)
        return m.step_s + m.prefill_token_s * 8192 + m.prefill_pair_s * 8192 * 8193 / 2

    h100, a100 = (sum(prefill_8k(x) for x in mesh.workers if x.gpu == g) / 2 for g in ("H100", "A100"))
    truth = Roofline(GPUS["A100"]).step_time([(0, 8192)], []) / Roofline(GPUS["H100"]).step_time([(0, 8192)], [])
    assert a100 / h100 == pytest.approx(truth, rel=0.25)
