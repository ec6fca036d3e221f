"""One decide sequence (router/core/decide.py): a replay of the same requests through the live router's
request path, the endpoint picker's and the simulator's router makes the same picks, request after request.

Each front gets its own copy of the same mesh: three workers registered in a kv_service core over the
memory store (the simulator's index), some holding conversations' prefixes, with different loads; one clock
they all read, moved on between requests. The replay is a multi-turn workload whose turns extend earlier
prompts, so the index's matches, the speculative map, this router's in-flight view and the shared view's
reservations (folded into the Lookup) all weigh on the picks. A front whose driver drifted from the sequence
(no request id, roles split after the tentative pick, a step skipped) picks differently somewhere.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import replace
from types import SimpleNamespace

import pytest

from kvmesh.contract.block_hash import XXH3_128, BlockHasher
from kvmesh.contract.index_protocol import Registration
from kvmesh.contract.kv_transfer import DECODE, PREFILL
from kvmesh.contract.types import BlockStored, Load, ModelSpec, SamplingParams
from kvmesh.replay.records import RequestRecord
from kvmesh.router.api.frontend import Frontend
from kvmesh.router.api.gateway import GatewayRequest, Pick
from kvmesh.router.config import EppConfig, RouterConfig, RoutingConfig
from kvmesh.router.core.decide import Decided
from kvmesh.router.core.policies.base import NO_OBJECTIVES, PolicyConfig
from kvmesh.router.core.upstream import WorkerEndpoint
from kvmesh.router.generate_types import GenerateInput
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.model_router import ModelRouter
from kvmesh.router.models import ModelSet
from kvmesh.router.request.context import RequestContext
from kvmesh.sim.config import MODEL_ID, SimConfig
from kvmesh.sim.events import EventQueue
from kvmesh.sim.index import SimIndex
from kvmesh.sim.pd import PDSimRouter, PDStats
from kvmesh.sim.router import SimRouter

BS = 4
SPEC = ModelSpec(MODEL_ID, BS, XXH3_128)
SEED = 7
WORKERS = ("w0", "w1", "w2")
LOADS = {"w0": Load(num_running=3, num_waiting=1, queued_prefill_tokens=40, num_free_blocks=900, num_total_blocks=1000),
         "w1": Load(num_running=1, num_free_blocks=950, num_total_blocks=1000),
         "w2": Load(num_free_blocks=1000, num_total_blocks=1000)}


def replay(conversations: int = 4, turns: int = 5, seed: int = 3) -> list[tuple[list[int], int]]:
    """(prompt ids, max tokens) per request: conversations interleaved, each turn its predecessor plus a reply
    and a question (7-40 tokens each), some conversations sharing a system prompt."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 30000) for _ in range(rng.randrange(20, 60))] for _ in range(2)]
    prompts = [list(systems[c % 2]) for c in range(conversations)]
    out = []
    for _ in range(turns):
        for c in range(conversations):
            prompts[c] += [rng.randrange(1, 30000) for _ in range(rng.randrange(7, 40))]
            out.append((list(prompts[c]), rng.randrange(1, 64)))
    return out


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def seeded_index(q: EventQueue, cfg: SimConfig, roles: dict[str, str], held: dict[str, list[int]]) -> SimIndex:
    """The same mesh for every front: the workers registered with their roles and loads, each holding the
    blocks of its ``held`` prompt."""
    index = SimIndex(q, cfg)
    hasher = BlockHasher(MODEL_ID, BS, XXH3_128)
    for w in WORKERS:
        index.write("register", Registration(w, f"{w}.mesh:50061", MODEL_ID, BS, XXH3_128, 1000, 1, role=roles[w]))
        events = [BlockStored(hasher.hash_prompt(held[w]))] if held.get(w) else []
        index.write("publish", w, 1, 1, events, LOADS[w])
    return index


class IndexPool:
    """The live router's worker pool over the simulator's index: discovery is its ListWorkers."""

    discovers_from_index = True
    problem = ""

    def __init__(self, index: SimIndex) -> None:
        self.index = index

    def endpoints(self) -> list[WorkerEndpoint]:
        return self.index.endpoints()

    def model_spec(self) -> ModelSpec:
        return SPEC

    def healthy(self, worker_id: str) -> bool:
        return True

    def mark_unhealthy(self, worker_id: str) -> None:
        raise AssertionError("no attempt fails in a replay")


class AsyncIndex:
    """The simulator's index as the live router's kv_service client (router/core/upstream.py's AsyncPrefixIndex)."""

    def __init__(self, index: SimIndex) -> None:
        self.index = index

    async def lookup(self, model_id, block_hashes):
        return self.index.lookup(model_id, block_hashes)

    async def lookup_reserve(self, model_id, block_hashes, reservation):
        return self.index.lookup_reserve(model_id, block_hashes, reservation)

    async def reserve(self, reservation):
        return self.index.write("reserve", reservation)


def routing(fold: bool, pd_mode: str = "auto", clock: Clock | None = None) -> RoutingConfig:
    pc = PolicyConfig(seed=SEED * 1000, **({"clock": clock} if clock is not None else {}))
    return replace(RoutingConfig(shared_view=True, fold_reserve=fold, speculative_ttl_s=2.0),
                   policy_config=pc, pd=replace(RoutingConfig().pd, pd_mode=pd_mode))


def sim_config(fold: bool, pd: bool) -> SimConfig:
    # NOTE: no latency anywhere: each request is decided at the instant it arrives, as the live fronts do here
    return SimConfig(workers=len(WORKERS), routers=1, seed=SEED, block_size=BS, lookup_latency_s=0.0,
                     reserve_latency_s=0.0, network_s=0.0, routing=routing(fold, "auto" if pd else "auto"),
                     **({"pd": "1:2"} if pd else {}))


class Host:
    """What a simulated router reads of its mesh (kvmesh/sim/router.py's RouterHost), the workers left out:
    a forwarded request is recorded, never served (in flight to the end, as a handed-off pick is)."""

    def __init__(self, cfg: SimConfig, chains: list[list[bytes]], roles: dict[str, str], held) -> None:
        self.cfg = cfg
        self.q = EventQueue()
        self.index = seeded_index(self.q, cfg, roles, held)
        self.spec = SPEC
        self.chains = chains
        self.workers = [SimpleNamespace(worker_id=w, role=roles[w]) for w in WORKERS]
        self.workers_by_id = {w: SimpleNamespace(submit=None) for w in WORKERS}
        self.pd_stats = PDStats()
        self.objectives = NO_OBJECTIVES  # NOTE: the replay's requests carry none (as the live requests here)
        self.workload = SimpleNamespace(requests=[SimpleNamespace(adapter="") for _ in chains])  # nor adapters

    def request_done(self, rec: RequestRecord) -> None:
        raise AssertionError(f"request {rec.index} ended in the replay: {rec.failed}")

    def expect(self, dt: float) -> None:
        pass

    def forward(self, dt: float, submit, *args) -> None:
        pass


def simulated(requests, fold: bool, roles, held, pd: bool) -> list[tuple[str, str | None]]:
    cfg = sim_config(fold, pd)
    hasher = BlockHasher(MODEL_ID, BS, XXH3_128)
    host = Host(cfg, [hasher.hash_prompt(ids) for ids, _ in requests], roles, held)
    router = PDSimRouter(host, 0, "auto") if pd else SimRouter(host, 0)
    picks: list[tuple[str, str | None]] = []
    decided = router._decided

    def record(rec, d: Decided, delay):
        picks.append((d.decision.worker_id, d.pd.prefill_worker if d.pd is not None else None))
        decided(rec, d, delay)

    router._decided = record
    router.workers.update(host.index.endpoints())
    for i, (ids, out) in enumerate(requests):
        host.q.now = i * 0.5
        router.route(RequestRecord(i, host.q.now, len(ids), out))
        while host.q.pop():
            pass
        assert len(picks) == i + 1, "the simulated router decided every request at once"
    return picks


def live(requests, fold: bool, roles, held, pd_mode: str) -> list[tuple[str, str | None]]:
    clock = Clock()
    q = EventQueue()
    index = seeded_index(q, sim_config(fold, False), roles, held)
    router = ModelRouter(RouterConfig(routing=routing(fold, pd_mode, clock)), IndexPool(index), AsyncIndex(index))
    picks = []

    async def run() -> None:
        for i, (ids, out) in enumerate(requests):
            clock.t = q.now = i * 0.5
            ctx = RequestContext(GenerateInput(None, ids, SamplingParams(max_tokens=out)), f"r{i}.1")
            d = await router.pipeline.decide(ctx)
            router.hand_off(d.plan, d.decision, ctx.request_id)  # in flight to the end, as the others
            picks.append((d.decision.worker_id, d.pd.prefill_worker if d.pd is not None else None))

    asyncio.run(run())
    return picks


def picked(requests, fold: bool, roles, held) -> list[tuple[str, None]]:
    clock = Clock()
    q = EventQueue()
    index = seeded_index(q, sim_config(fold, False), roles, held)
    config = RouterConfig(model_id=MODEL_ID, routing=routing(fold, "auto", clock))
    models = ModelSet(config, lambda _m: IndexPool(index), AsyncIndex(index), RouterMetrics())
    frontend = Frontend(models, 100, RouterMetrics())
    by_endpoint = {f"{w}.mesh:50061": w for w in WORKERS}
    picks = []

    async def run() -> None:
        for i, (ids, out) in enumerate(requests):
            clock.t = q.now = i * 0.5
            g = GatewayRequest(frontend, config, EppConfig())
            assert g.on_headers({":path": "/v1/completions", "x-request-id": f"r{i}"}, None, False) is None
            body = json.dumps({"model": MODEL_ID, "prompt": ids, "max_tokens": out}).encode()
            pick = await g.on_body(body, True)
            assert isinstance(pick, Pick), pick
            picks.append((by_endpoint[pick.endpoints[0]], None))
            g.finished_without_response = None  # the handoff stays open: in flight to the end

    asyncio.run(run())
    return picks


HELD = {"w0": replay()[0][0][:40], "w1": replay()[1][0][:24]}


@pytest.mark.parametrize("fold", [False, True], ids=["reserve", "folded"])
def test_router_picker_and_simulator_pick_alike(fold):
    requests = replay()
    roles = dict.fromkeys(WORKERS, "both")
    sim = simulated(requests, fold, roles, HELD, pd=False)
    assert len(set(w for w, _ in sim)) > 1, "a replay that sends everything to one worker shows nothing"
    assert live(requests, fold, roles, HELD, "auto") == sim
    assert picked(requests, fold, roles, HELD) == sim


def test_a_fleet_with_roles_decides_alike_live_and_simulated():
    requests = replay()
    roles = {"w0": PREFILL, "w1": DECODE, "w2": DECODE}
    sim = simulated(requests, True, roles, HELD, pd=True)
    assert all(w != "w0" for w, _ in sim), "the decode pick is among the workers that decode"
    assert live(requests, True, roles, HELD, "auto") == sim
