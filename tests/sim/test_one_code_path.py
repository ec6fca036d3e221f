"""The simulator runs the live cores: a short run calls each of them (it re-implements none).

Each core is wrapped to count its calls during one simulated run with faults (event loss, a
restart, two routers); every count must be positive. A simulator that grew its own copy of a core
(batching, attempts, the worker set, the plan, the window commit) would leave that count at 0.
"""

from __future__ import annotations

import functools

import pytest

from kvmesh.kv_client.event_batcher import EventBatcher
from kvmesh.kv_service.service import KVService
from kvmesh.router.config import RoutingConfig
from kvmesh.router.core.attempts import Attempts
from kvmesh.router.core.decide import DecideSequence
from kvmesh.router.core.reservation_loop import ReservationLoop
from kvmesh.router.core.routing import RoutingCore
from kvmesh.router.core.worker_set import WorkerSet
from kvmesh.sim.config import SimConfig
from kvmesh.sim.engine import WindowScheduler
from kvmesh.sim.run import Sim
from kvmesh.sim.workload import make_workload

CORES = [
    (EventBatcher, "take"), (EventBatcher, "take_snapshot"), (EventBatcher, "resync"),
    (DecideSequence, "lookup"), (DecideSequence, "answered"), (DecideSequence, "pick"), (DecideSequence, "commit"),
    (RoutingCore, "prepare"), (RoutingCore, "complete"), (RoutingCore, "pick"),
    (ReservationLoop, "next"), (ReservationLoop, "answered"),
    (Attempts, "next"), (Attempts, "failed"),
    (WorkerSet, "update"), (WorkerSet, "mark_unhealthy"),
    (KVService, "publish"), (KVService, "snapshot"), (KVService, "lookup"),
    (WindowScheduler, "update_from_window"),
]


def test_a_simulated_run_drives_every_live_core(monkeypatch):
    calls = {f"{cls.__name__}.{name}": 0 for cls, name in CORES}
    for cls, name in CORES:
        original = getattr(cls, name)

        @functools.wraps(original)
        def counted(*args, _key=f"{cls.__name__}.{name}", _original=original, **kwargs):
            calls[_key] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(cls, name, counted)
    w = make_workload("multi-turn", 120, seed=1)
    # NOTE: kv-aware asks the index; round robin with no health marks keeps sending to the dead
    # worker, so the attempts retry elsewhere.
    for policy, unhealthy_s in (("kv-aware", 5.0), ("round-robin", 0.0)):
        cfg = SimConfig(workers=3, routers=2, seed=5, event_loss=0.3, restart_at=[0.4], restart_down_s=3.0,
                        routing=RoutingConfig(unhealthy_s=unhealthy_s))
        res = Sim(w, cfg).run(policy, 4.0)
        assert res["completed"] + res["failed"] == 120
    assert all(n > 0 for n in calls.values()), {k: n for k, n in calls.items() if not n}


@pytest.mark.parametrize("module", ["kvmesh.sim.mesh", "kvmesh.sim.router", "kvmesh.sim.worker", "kvmesh.sim.index",
                                    "kvmesh.sim.engine", "kvmesh.sim.run"])
def test_the_simulator_defines_no_core_of_its_own(module):
    # the behaviours the live mesh has are imported, not defined again under kvmesh/sim/
    import importlib

    mod = importlib.import_module(module)
    defined = {n for n, v in vars(mod).items() if isinstance(v, type) and v.__module__ == module}
    assert not defined & {"EventBatcher", "Attempts", "WorkerSet", "RoutingCore", "ReservationLoop", "DecideSequence",
                          "KVService", "Scheduler",
                          "LLMEngine", "SpeculativeIndex", "InFlight", "KVPublisher"}


def test_a_simulated_run_loads_neither_redis_nor_grpc():
    # the simulator is one process: its index is the memory store (kv_service/stores.py loads a store's
    # module only when asked for it), its wire is the event queue
    import subprocess
    import sys

    code = ("import sys\n"
            "from kvmesh.sim.config import SimConfig\n"
            "from kvmesh.sim.run import Sim\n"
            "from kvmesh.sim.workload import make_workload\n"
            "res = Sim(make_workload('multi-turn', 40, seed=1), SimConfig(workers=2, routers=2, seed=1)).run('kv-aware', 2.0)\n"
            "assert res['completed'] == 40, res\n"
            "print(sorted(m for m in ('redis', 'grpc') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
