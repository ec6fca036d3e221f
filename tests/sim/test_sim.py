"""The virtual-time simulator (kvmesh/sim/): determinism, a cache win by construction, the capacity
search on a toy cost model with a known answer, faults and several routers."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvmesh.kv_service.service import run_now
from kvmesh.model_worker.scheduling.config import SchedulerConfig
from kvmesh.model_worker.simulated.step_time import LinearCost
from kvmesh.sim.config import SimConfig
from kvmesh.sim.mesh import Mesh
from kvmesh.sim.run import Sim, chains_for, oracle_hit_rate, sim_model_dir
from kvmesh.sim.workload import SimRequest, Workload, make_workload, shared_prefix, trace_workload
from tests.support.sim import simulate


@pytest.mark.timeout(180)
def test_same_seed_gives_byte_identical_json_across_processes(tmp_path):
    args = ["--workload", "hot-prompt", "--max-requests", "60", "--workers", "3", "--routers", "2",
            "--policies", "kv-aware,round-robin,preble,dynamo,llm-d", "--rates", "4", "--relative-rates", "", "--no-capacity",
            "--event-loss", "0.2", "--no-progress"]
    outs = []
    for n, hashseed in enumerate(("1", "2")):
        out = tmp_path / f"{n}.json"
        proc = simulate([*args, "--json", str(out)], {"PYTHONHASHSEED": hashseed})
        assert proc.returncode == 0, proc.stderr
        outs.append(out.read_bytes())
    assert outs[0] == outs[1]
    # a different seed is a different run (tokens, tie-breaks, lost batches)
    other = Sim(make_workload("hot-prompt", 60, seed=1), SimConfig(workers=3, routers=2, event_loss=0.2))
    assert other.run("kv-aware", 4.0)["lost_event_batches"] != 0


@pytest.mark.timeout(300)
def test_a_sweep_in_two_processes_gives_the_json_of_one():
    # two processes run the searches and the runs in whatever order they finish (the runs scaled by
    # the baseline's capacity start as soon as it is known); the document is the serial one
    from kvmesh.sim.run import dump, sweep

    sim = Sim(make_workload("hot-prompt", 40, seed=3), SimConfig(workers=2, seed=3))
    kw = dict(rates=[3.0], relative=[0.5, 1.0], baseline="kv-aware", progress=False)
    policies = ["round-robin", "least-loaded", "kv-aware"]  # NOTE: the baseline's search is submitted first
    serial = sweep(sim, policies, jobs=1, **kw)
    parallel = sweep(sim, policies, jobs=2, **kw)
    cap = serial["capacity"]["kv-aware"]
    assert cap > 0
    assert list(serial["capacity"]) == policies
    assert [(r["policy"], r["rate"]) for r in serial["runs"]] == [
        ("round-robin", 3.0), ("least-loaded", 3.0), ("kv-aware", 3.0),
        *((p, round(x * cap, 6)) for p in policies for x in (0.5, 1.0))]
    assert dump(parallel) == dump(serial)


def test_kv_aware_hits_the_shared_prefixes_round_robin_scatters():
    # 4 groups behind 2048-token prefixes, slow arrivals: a cache-aware router sends every group's
    # requests to the worker that computed its prefix; round robin spreads each group over all 4.
    w = shared_prefix(num_requests=48, groups=4, prefix_len=2048, question_len=128, output_len=4, base_rate=0.5)
    sim = Sim(w, SimConfig(workers=4))
    kv, rr = sim.run("kv-aware", 1.0), sim.run("round-robin", 1.0)
    oracle = oracle_hit_rate(w, sim.base)
    assert kv["hit_rate"] >= 0.9 * oracle
    assert rr["hit_rate"] < 0.8 * kv["hit_rate"]
    assert (kv["completed"], rr["completed"], kv["failed"]) == (48, 48, 0)


def test_capacity_search_finds_the_rate_a_toy_worker_saturates_at():
    # One worker, one 1000-token request per second, 1 output token, prefill only costed:
    # 0.8 s per request, one request per step. Requests queue once the gap 1/rate < 0.8 s, so the
    # SLO (TTFT <= 1 ms + 1 x the cold prefill) holds for >= 90 % exactly up to rate 1 / 0.8 = 1.25
    # (queueing grows ~0.8 ms per request just above it).
    reqs = [SimRequest(i, float(i), 1000, 1, ((-(i + 1), 1000),)) for i in range(100)]
    cost = LinearCost(step_overhead_s=0.0, prefill_token_s=8e-4, attn_pair_s=0.0, decode_seq_s=0.0, decode_kv_token_s=0.0)
    engine = replace(SimConfig().engine, max_num_batched_tokens=1000)
    sim = Sim(Workload("toy", reqs), SimConfig(workers=1, engine=engine, cost=cost, slo_ttft_s=0.001,
                                               slo_ttft_prefill_x=1.0, network_s=0.0, lookup_latency_s=0.0))
    capacity, runs = sim.capacity("round-robin")
    assert 1.25 / 1.02 <= capacity <= 1.2511
    assert len(runs) <= 10 and any(r["stopped_early"] for r in runs)


def _one_worker_sim(reqs: list[SimRequest]) -> Sim:
    """One worker that prefills one 1000-token request per 0.8 s step; TTFT SLO 1 ms + 1 x the cold prefill."""
    cost = LinearCost(step_overhead_s=0.0, prefill_token_s=8e-4, attn_pair_s=0.0, decode_seq_s=0.0, decode_kv_token_s=0.0)
    engine = replace(SimConfig().engine, max_num_batched_tokens=1000)
    return Sim(Workload("toy", reqs), SimConfig(workers=1, engine=engine, cost=cost, slo_ttft_s=0.001,
                                                slo_ttft_prefill_x=1.0, network_s=0.0, lookup_latency_s=0.0))


def test_capacity_search_stops_when_no_rate_spreads_the_misses():
    # Ten requests arrive in one instant (a rate scales arrival times, so they stay together) on
    # one worker that prefills one per step: the later ones miss the TTFT SLO at every rate. After
    # two failures the search tries the lowest rate its bracket reaches; that fails too, so it stops
    # at capacity 0 after three runs instead of stepping through ever lower (and ever longer) rates.
    sim = _one_worker_sim([SimRequest(i, 0.0, 1000, 1, ((-(i + 1), 1000),)) for i in range(10)])
    capacity, runs = sim.capacity("round-robin")
    assert capacity == 0.0
    assert [r["rate"] for r in runs] == [1.0, round(1 / 1.5, 6), round(1 / 1.5 ** 11, 6)]
    assert not any(sim.passes(r) for r in runs)


def test_capacity_search_past_two_failures_still_finds_a_low_capacity():
    # The toy worker of the search test above saturates at 1.25 requests/s; started at 4, the
    # search fails at 4 and 2.67, finds the floor (4 / 1.5 ** 11) passing, and goes on down to
    # bracket 1.25: the floor's pass is no capacity of its own, nor is its run made twice.
    sim = _one_worker_sim([SimRequest(i, float(i), 1000, 1, ((-(i + 1), 1000),)) for i in range(100)])
    capacity, runs = sim.capacity("round-robin", start=4.0)
    rates = [r["rate"] for r in runs]
    assert 1.25 / 1.02 <= capacity <= 1.2511, rates
    assert rates[:3] == [4.0, round(4 / 1.5, 6), round(4 / 1.5 ** 11, 6)]
    assert sim.passes(runs[2]) and len(set(rates)) == len(rates)


def test_event_loss_restart_and_three_routers_finish_and_resync():
    w = load_trace_or_generated()
    cfg = SimConfig(workers=4, routers=3, event_loss=0.3, restart_at=[0.5], restart_down_s=1.0, seed=3)
    mesh = Mesh(cfg, w, sim_model_dir(), chains_for(w, cfg.block_size))
    records = mesh.run()
    assert all(r.finish is not None or r.failed for r in records)
    failed = [r for r in records if r.failed]
    # only streams cut by the restart fail (those before their first token were retried elsewhere)
    assert all("mid-stream" in r.failed for r in failed) and len(failed) < 0.1 * len(records)
    assert mesh.lost_batches > 0 and sum(x.resyncs for x in mesh.workers) > 0
    assert mesh.workers[0].epoch == 2 and sum(len(r.observer.decisions) > 0 for r in mesh.routers) == 3
    assert sum(r.cached_tokens for r in records) > 0  # the index stayed useful through the losses
    # the index holds what worker 0's new incarnation reported: never a block of its old cache
    svc = mesh.index.svc
    info = {i.registration.worker_id: i for i in run_now(svc.index.workers(int(mesh.q.now * 1000)))}
    assert info["worker-000"].registration.epoch == 2


def _index_lag(load_on_events: bool) -> float:
    """Mean over probes every 0.25 s of |requests at a worker by the index - by its engine|."""
    w = load_trace_or_generated()
    cfg = SimConfig(workers=4, routers=3, seed=2, load_reports="events" if load_on_events else "heartbeat")
    mesh = Mesh(cfg, w, sim_model_dir(), chains_for(w, cfg.block_size))
    gaps: list[int] = []
    end = w.requests[-1].arrival_s

    def probe() -> None:
        held = {i.registration.worker_id: i.load for i in run_now(mesh.index.svc.index.workers(int(mesh.q.now * 1000)))}
        for worker in mesh.workers:
            if worker.engine is not None and worker.worker_id in held:
                now, seen = worker.load_now(), held[worker.worker_id]
                gaps.append(abs(now.num_running + now.num_waiting - seen.num_running - seen.num_waiting))
        if mesh.q.now < end:
            mesh.q.after(0.25, probe)

    mesh.q.at(1.0, probe)
    mesh.run()
    assert len(gaps) > 100
    return sum(gaps) / len(gaps)


def test_event_messages_keep_the_index_load_fresh_for_every_router():
    # Three routers each see only their own in-flight requests; the rest they learn from the load
    # the index holds. Carried by the event stream (the live publisher), it trails the engine by a
    # message slot; by heartbeats alone, by up to a heartbeat period (3.3 s).
    fresh, stale = _index_lag(True), _index_lag(False)
    assert fresh < 0.5 and fresh < stale / 3, (fresh, stale)


def test_a_prompt_longer_than_the_engines_accept_fails_without_stopping_the_run():
    reqs = [SimRequest(i, float(i), n, 4, ((-(i + 1), n),)) for i, n in enumerate((1000, 5000, 1000))]
    sim = Sim(Workload("long", reqs), SimConfig(workers=2, engine=replace(SimConfig().engine, max_model_len=4096)))
    res = sim.run("kv-aware", 1.0)
    assert (res["completed"], res["failed"]) == (2, 1)


def test_mid_step_reports_count_the_requests_the_step_took_in():
    # The live engine reports, while a step runs, the state before it plus every request it took
    # from its inbox (LLMEngine._drained). The simulator computes a step's end at its start; its
    # report must still count the step's new requests (it once dropped them for the step's length,
    # so other routers, whose picks the admission had retired, saw an idle worker).
    reqs = [SimRequest(0, 0.0, 20_000, 4, ((-1, 20_000),))]
    mesh = Mesh(SimConfig(workers=1, seed=0), Workload("one", reqs), sim_model_dir(),
                chains_for(Workload("one", reqs), 64))
    seen = []

    def probe() -> None:
        worker = mesh.workers[0]
        assert worker.stepping and mesh.q.now < worker.busy_until  # inside the first prefill step
        seen.append(worker.load_now())

    mesh.q.at(0.02, probe)
    mesh.run()
    assert seen and seen[0].num_waiting + seen[0].num_running == 1
    assert seen[0].queued_prefill_tokens == 20_000

def load_trace_or_generated() -> Workload:
    from pathlib import Path

    trace = Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"
    if trace.exists():
        return trace_workload(trace, 200)
    return make_workload("multi-turn", 200)


def test_a_run_that_raises_is_reported_and_the_sweep_keeps_the_rest(monkeypatch, tmp_path, capsys):
    # A defect inside one policy's runs (here: a pick that raises, as issue 29's KeyError did) must
    # not throw away the other policies' finished results: the JSON lists the failure with its
    # policy, rate and seed, keeps the rest, and the command exits non-zero.
    from kvmesh.commands import simulate as cmd
    from kvmesh.router.core.policies import POLICIES

    cls = POLICIES["least-loaded"]

    def broken(self, query, candidates):
        raise KeyError("worker-002")

    monkeypatch.setattr(cls, "pick", broken)
    out = tmp_path / "sim.json"
    import argparse
    import json

    parser = argparse.ArgumentParser()
    cmd.register(parser.add_subparsers())
    args = parser.parse_args(["simulate", "--workload", "hot-prompt", "--max-requests", "30", "--workers", "2",
                              "--policies", "round-robin,least-loaded", "--rates", "2", "--relative-rates", "",
                              "--no-capacity", "--no-progress", "--seed", "7", "--json", str(out)])
    assert args.func(args) == 1
    doc = json.loads(out.read_text())
    assert [r["policy"] for r in doc["runs"]] == ["round-robin"]
    assert doc["failures"] == [{"kind": "run", "policy": "least-loaded", "rate": 2.0, "seed": 7,
                                "error": "KeyError: 'worker-002'"}]
    err = capsys.readouterr().err
    assert "policy least-loaded at rate 2 (seed 7) failed" in err and "raise KeyError" in err


def test_a_host_tier_keeps_prefixes_the_device_cannot_and_the_simulator_runs_it():
    """The simulator's engines run the worker's host tier: 8 prefixes of 2,048 tokens over two
    workers whose devices hold about two each; with a host tier of the rest, a prefix that fell out
    of the device is loaded back (a hit) instead of recomputed."""
    w = shared_prefix(num_requests=64, groups=8, prefix_len=2048, question_len=64, output_len=4, base_rate=2.0)
    engine = SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=4096)
    # 79 usable blocks of 64 tokens per worker: about two prefixes and their questions
    base = SimConfig(workers=2, num_blocks=80, engine=engine)
    off = Sim(w, base).run("kv-aware", 1.0)
    on = Sim(w, replace(base, host_kv_blocks=512)).run("kv-aware", 1.0)
    assert (on["completed"], off["completed"]) == (64, 64)
    assert on["hit_rate"] > 1.5 * off["hit_rate"]
    with pytest.raises(ValueError, match="--host-kv-blocks must be >= 0"):
        replace(base, host_kv_blocks=-1).check()


def test_lookups_from_a_lagging_replica_see_the_primary_as_it_was():
    # --read-replica-lag: the replica applies each write of the primary that much later, with its time
    from kvmesh.contract.block_hash import XXH3_128
    from kvmesh.contract.index_protocol import Registration
    from kvmesh.contract.types import BlockStored
    from kvmesh.sim.config import MODEL_ID
    from kvmesh.sim.events import EventQueue
    from kvmesh.sim.index import SimIndex

    cfg = SimConfig(workers=1, read_replica_lag_s=0.005)
    q = EventQueue()
    index = SimIndex(q, cfg)
    chain = [bytes([i]) * 16 for i in range(4)]

    def seen() -> list[tuple[str, int]]:
        return [(m.worker_id, m.matched_blocks) for m in index.lookup(MODEL_ID, chain)]

    index.write("register", Registration("w", "sim:1", MODEL_ID, cfg.block_size, XXH3_128, 100, 1))
    q.now = 0.001
    index.write("publish", "w", 1, 1, [BlockStored(chain[:3])], None)
    q.now = 0.004
    assert seen() == []  # the registration has not reached the replica
    assert [m.matched_blocks for m in run_now(index.svc.lookup(MODEL_ID, chain))] == [3]
    q.now = 0.005
    assert seen() == [("w", 0)]
    q.now = 0.006
    assert seen() == [("w", 3)]
    # lag 0: the primary answers
    assert SimIndex(EventQueue(), SimConfig(workers=1)).replica is None
