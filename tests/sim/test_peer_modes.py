"""The peers' multi-router modes in the simulator (kvmesh/sim/replicas.py): Dynamo's replica sync
(a peer's active sequences one batch period and one hop later), llm-d's per-router 50 ms load
scrapes out of phase, and every policy running with several routers."""

from __future__ import annotations

import dataclasses

import pytest

from kvmesh.router.core.policies import policy_names
from kvmesh.router.core.policies.dynamo import DynamoPolicy
from kvmesh.sim.config import SimConfig
from kvmesh.sim.mesh import Mesh
from kvmesh.sim.run import Sim, chains_for, sim_model_dir
from kvmesh.sim.workload import SimRequest, Workload, make_workload


def _mesh(policy: str, **changes) -> Mesh:
    # three requests on their own: r0 at 1 s (router 0), r1 at 5 s (router 1), r2 at 9 s (router 0)
    reqs = [SimRequest(i, t, 1000, 50, ((-(i + 1), 1000),)) for i, t in enumerate((1.0, 5.0, 9.0))]
    w = Workload("three", reqs)
    cfg = Sim(w, SimConfig(workers=2, routers=2, **changes)).config(policy, 1.0)
    return Mesh(cfg, w, sim_model_dir(), chains_for(w, cfg.block_size))


def test_replica_sync_shows_a_peers_request_after_the_batch_period_and_a_hop():
    mesh = _mesh("dynamo")
    a, b = (r.core.policy for r in mesh.routers)
    assert isinstance(a, DynamoPolicy) and isinstance(b, DynamoPolicy)
    seen: list[tuple[float, tuple[int, int, int]]] = []

    def probe() -> None:
        worker = mesh.records[0].worker
        seen.append((round(mesh.q.now, 4), b.sequences.view(worker, mesh.chains[0])))

    # router 0 routes r0 at 1.0 s; its add goes out 1 ms later and reaches router 1 one hop (1 ms) after
    for t in (1.0019, 1.0021):
        mesh.q.at(t, probe)
    mesh.run()
    blocks = len(mesh.chains[0])
    assert seen == [(1.0019, (0, 0, blocks)), (1.0021, (blocks, 1000, 0))]
    assert len(b.sequences) == 1  # the last request's free is still on its way ...
    end = mesh.q.now
    while mesh.q.now < end + 0.0025 and mesh.q.pop():
        pass
    assert len(a.sequences) == len(b.sequences) == 0  # ... and reaches router 1 within 2 ms
    assert mesh.peer_modes.sync is not None and mesh.peer_modes.sync.batches_sent >= 6


def test_without_replica_sync_each_router_keeps_its_own_sequences():
    mesh = _mesh("dynamo", replica_sync=False)
    b = mesh.routers[1].core.policy
    seen = []
    mesh.q.at(1.01, lambda: seen.append(len(b.sequences)))
    mesh.run()
    assert seen == [0] and mesh.peer_modes.sync is None


def test_llmd_routers_scrape_every_worker_every_50ms_out_of_phase():
    mesh = _mesh("llm-d")
    times: dict[int, list[float]] = {0: [], 1: []}
    for i, r in enumerate(mesh.routers):
        policy = r.core.policy
        original = policy.scraped

        def record(worker_id, load, i=i, original=original):
            times[i].append(mesh.q.now)
            original(worker_id, load)

        policy.scraped = record  # type: ignore[method-assign]
    mesh.run()
    hop = mesh.cfg.network_s
    for i, phase in ((0, 0.0), (1, 0.025)):
        first = times[i][:6]  # 2 workers a scrape
        assert first == pytest.approx([phase + hop] * 2 + [phase + 0.05 + hop] * 2 + [phase + 0.1 + hop] * 2)
    assert set(mesh.routers[0].core.policy._scraped) == {w.worker_id for w in mesh.workers}


@pytest.mark.timeout(240)
def test_every_policy_runs_with_three_routers():
    w = make_workload("shared-prefix", 30, seed=2)
    base = SimConfig(workers=3, routers=3, seed=4)
    for policy in policy_names():
        res = Sim(w, base).run(policy, 1.0)
        assert (res["completed"], res["failed"]) == (30, 0), policy
    off = Sim(w, dataclasses.replace(base, replica_sync=False)).run("dynamo", 1.0)
    assert off["completed"] == 30
