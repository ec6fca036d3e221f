"""router/request/: stages alone."""

from __future__ import annotations

import asyncio

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.types import SamplingParams
from kvmesh.router.config import RoutingConfig
from kvmesh.router.core.pd import PDDecider
from kvmesh.router.core.policies import make_policy
from kvmesh.router.core.policies.base import PolicyConfig
from kvmesh.router.core.routing import RoutingCore
from kvmesh.router.generate_types import GenerateInput
from kvmesh.router.metrics import RouterMetrics
from kvmesh.router.request.context import RequestContext
from kvmesh.router.request.decide import HASH_ON_LOOP_TOKENS, Decide
from kvmesh.router.request.pd_decision import CountedDecider
from tests.support.router import FakeIndex, FakePool


def decide_stage(offload) -> tuple[Decide, RoutingCore]:
    core = RoutingCore(make_policy("kv-aware", PolicyConfig(seed=0)))
    routing = RoutingConfig()
    decider = CountedDecider(PDDecider(routing.pd), RouterMetrics())
    return Decide(core, FakePool({"w1": [], "w2": []}), FakeIndex({"w1": 3}), "auto", decider, lambda _o: None,
                  offload=offload), core


def test_a_long_prompt_is_hashed_off_the_loop_and_a_short_one_on_it():
    ran: list[int] = []

    async def offload(fn, *args):
        ran.append(len(args[1]))
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    stage, core = decide_stage(offload)
    long_ids = [i % 30000 for i in range(HASH_ON_LOOP_TOKENS + 4)]
    short_ids = long_ids[:64]

    async def run(ids):
        ctx = RequestContext(GenerateInput(None, ids, SamplingParams()), "r", token_ids=ids)
        await stage(ctx)
        return ctx.decided

    d = asyncio.run(run(long_ids))
    assert ran == [len(long_ids)]
    assert d.plan.query.block_hashes == BlockHasher("m", 4).hash_prompt(long_ids)
    asyncio.run(run(short_ids))
    assert ran == [len(long_ids)]  # the short one was not handed to the pool


def test_a_request_no_worker_is_predicted_to_meet_is_refused_unless_it_is_a_continuation():
    from dataclasses import replace

    import pytest

    from kvmesh.contract.errors import ResourceExhausted
    from kvmesh.router.core.policies.base import ObjectiveMiss, Objectives
    from kvmesh.router.core.policies.kv_aware import KvAwarePolicy

    class Missing(KvAwarePolicy):
        def objective_miss(self, query, candidates):
            return ObjectiveMiss("tpot", query.objectives.tpot_s, 0.25) if query.objectives else None

    counted: list[str] = []
    stage, core = decide_stage(None)
    core.policy = Missing(PolicyConfig(seed=0))
    stage.refused = counted.append
    ids = list(range(3, 67))

    def run(objectives: Objectives, **kw):
        ctx = RequestContext(replace(GenerateInput(None, ids, SamplingParams()), objectives=objectives), "r",
                             token_ids=ids)
        asyncio.run(stage(ctx, **kw))
        return ctx.decided

    with pytest.raises(ResourceExhausted, match=r"TPOT objective of 20 ms \(the best predicted is 250 ms\)"):
        run(Objectives(tpot_s=0.02))
    assert counted == ["tpot"] and core.inflight.of("w1").requests == core.inflight.of("w2").requests == 0
    # a migration's continuation is never refused; its objectives still reach the policy
    assert run(Objectives(tpot_s=0.02), refuse=False).plan.query.objectives == Objectives(tpot_s=0.02)
    assert run(Objectives()).plan.query.objectives == Objectives()
    stage.refused = None  # no --slo-refuse
    assert run(Objectives(tpot_s=0.02)) is not None
    assert counted == ["tpot"]
