"""The request path (router/model_router.py) with fake workers and index: retries, failures, speculation."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.contract.block_hash import BlockHasher
from kvmesh.contract.errors import InvalidArgument, ResourceExhausted, Unavailable
from kvmesh.contract.types import SamplingParams, Usage
from kvmesh.router.config import RouterConfig, RoutingConfig
from kvmesh.router.core.policies.base import PolicyConfig
from kvmesh.router.core.upstream import (
    Failure,
    WorkerChunk,
    WorkerError,
)
from kvmesh.router.generate_types import GenerateInput
from kvmesh.router.model_router import ModelRouter
from tests.support.router import FakeIndex, FakePool, collect

PROMPT = list(range(1, 33))  # 8 blocks of 4
CHAIN = BlockHasher("m", 4).hash_prompt(PROMPT)


def ok(wid: str) -> list:
    return [WorkerChunk([7]), WorkerChunk([8], "length", Usage(32, 16, 2), wid)]


def err(failure: Failure) -> WorkerError:
    return WorkerError(failure, f"{failure.value} said the worker")


def run(router: ModelRouter, ids=PROMPT) -> list:
    return asyncio.run(collect(router.generate(GenerateInput(None, ids, SamplingParams(max_tokens=2)))))


def make(scripts: dict[str, list], index=None, **kw) -> tuple[ModelRouter, FakePool]:
    pool = FakePool(scripts)
    config = RouterConfig(routing=RoutingConfig(policy_config=PolicyConfig(seed=0), **kw))
    return ModelRouter(config, pool, index if index is not None else FakeIndex()), pool


def test_streams_tokens_and_last_message_carries_usage_and_served_by():
    router, pool = make({"w1": ok("w1"), "w2": ok("w2")}, FakeIndex({"w1": 8}))
    out = run(router)
    assert [(o.token_ids, o.finish_reason, o.usage, o.served_by) for o in out] == [
        ([7], None, None, ""), ([8], "length", Usage(32, 16, 2), "w1")]
    assert pool.calls == ["w1"] and router.inflight.view("w1") == (0, 0)


def test_the_pick_is_reserved_under_the_id_the_worker_sees_and_is_in_flight_once():
    index = FakeIndex({"w1": 8})
    router, pool = make({"w1": ok("w1"), "w2": ok("w2")}, index)
    seen = []
    real = router.core.start

    def start(plan, worker_id):  # what the in-flight view holds when the attempt starts
        ticket = real(plan, worker_id)
        seen.append(router.inflight.view(worker_id)[0])
        return ticket

    router.core.start = start
    run(router)
    assert [(c.worker_id, c.request_id, c.seen_version) for c in index.reservations] == [("w1", pool.request_ids[0], 0)]
    # NOTE: in flight from the pick (router/core/decide.py), reserved, then forwarded: one request each time, not two
    assert seen == [1, 1, 1]
    assert router.inflight.view("w1") == (0, 0)
    # Without the view (or for a policy that does not read it), nothing is reserved.
    index = FakeIndex({"w1": 8})
    run(make({"w1": ok("w1")}, index, shared_view=False)[0])
    run(make({"w1": ok("w1")}, index, policy="round-robin")[0])
    assert index.reservations == []


def test_unavailable_before_first_token_retries_on_next_best_and_marks_unhealthy():
    router, pool = make({"w1": [err(Failure.UNAVAILABLE)], "w2": ok("w2"), "w3": ok("w3")},
                        FakeIndex({"w1": 8, "w2": 4}))
    assert run(router)[-1].served_by == "w2"
    assert (pool.calls, pool.unhealthy) == (["w1", "w2"], {"w1"})


def test_invalid_argument_from_worker_is_not_retried():
    router, pool = make({"w1": [err(Failure.INVALID)], "w2": ok("w2")}, FakeIndex({"w1": 8}))
    with pytest.raises(InvalidArgument, match="invalid said the worker"):
        run(router)
    assert pool.calls == ["w1"]


def test_failure_after_first_token_ends_stream_with_unavailable_without_migration():
    router, pool = make({"w1": [WorkerChunk([7]), err(Failure.UNAVAILABLE)], "w2": ok("w2")},
                        FakeIndex({"w1": 8}), migration_limit=0)
    got = []

    async def read() -> None:
        async for o in router.generate(GenerateInput(None, PROMPT, SamplingParams())):
            got.append(o.token_ids)

    with pytest.raises(Unavailable, match=r"^the worker serving the request failed mid-stream \(unavailable\) and "
                                          r"it was migrated 0 time\(s\) already \(--migration-limit 0\)"):
        asyncio.run(read())
    assert (got, pool.calls, router.inflight.view("w1")) == ([[7]], ["w1"], (0, 0))


def test_a_stream_cut_mid_way_continues_on_another_worker_from_the_tokens_sent():
    """The continuation's prompt is the client's prompt plus exactly the tokens sent, for exactly the tokens
    still owed, under a new id; the client sees one stream whose usage is its prompt and whole completion."""
    w2 = [WorkerChunk([9]), WorkerChunk([10], "length", Usage(34, 20, 2), "w2")]
    router, pool = make({"w1": [WorkerChunk([7]), WorkerChunk([8]), err(Failure.UNAVAILABLE)], "w2": w2},
                        FakeIndex({"w1": 8}))
    outs = asyncio.run(collect(router.generate(GenerateInput(None, PROMPT, SamplingParams(max_tokens=4)))))
    assert [o.token_ids for o in outs] == [[7], [8], [9], [10]]
    assert pool.calls == ["w1", "w2"]
    first, second = pool.requests
    assert list(second.prompt_token_ids) == PROMPT + [7, 8] and second.sampling.max_tokens == 2
    assert second.request_id == first.request_id + ".m1"
    assert outs[-1].usage == Usage(32, 20, 4) and outs[-1].finish_reason == "length"
    assert "w1" in pool.unhealthy
    assert router.metrics.migrations._value.get() == 1
    assert router.inflight.view("w1") == (0, 0) and router.inflight.view("w2") == (0, 0)


def test_a_migration_is_routed_afresh_to_a_worker_that_joined_after_the_request_was():
    """The continuation is a new decision over the workers now: one that joined mid-stream takes it (the
    first plan never named it), and the worker that failed is not asked again."""
    scripts: dict[str, list] = {}
    joins = {"w2": [WorkerChunk([9]), WorkerChunk([10], "length", Usage(34, 0, 2), "w2")]}
    scripts["w1"] = [WorkerChunk([7]), WorkerChunk([8]), lambda: scripts.update(joins), err(Failure.UNAVAILABLE)]
    router, pool = make(scripts, FakeIndex({"w1": 8}))
    outs = asyncio.run(collect(router.generate(GenerateInput(None, PROMPT, SamplingParams(max_tokens=4)))))
    assert [o.token_ids for o in outs] == [[7], [8], [9], [10]]
    assert pool.calls == ["w1", "w2"] and outs[-1].served_by == "w2"
    assert list(pool.requests[1].prompt_token_ids) == PROMPT + [7, 8]


def test_migrations_stop_at_the_limit_and_count_from_the_first_prompt():
    """Two cuts with --migration-limit 1: the second ends the stream; the second continuation would have
    counted its tokens from the client's prompt, not the first continuation's."""
    cut = err(Failure.UNAVAILABLE)
    router, pool = make({"w1": [WorkerChunk([7]), cut], "w2": [WorkerChunk([8]), cut], "w3": ok("w3")},
                        FakeIndex({"w1": 8, "w2": 4}), migration_limit=1)
    with pytest.raises(Unavailable, match=r"migrated 1 time\(s\) already"):
        asyncio.run(collect(router.generate(GenerateInput(None, PROMPT, SamplingParams(max_tokens=5)))))
    assert len(pool.requests) == 2 and pool.requests[1].sampling.max_tokens == 4
    router, pool = make({"w1": [WorkerChunk([7]), cut], "w2": [WorkerChunk([8]), cut], "w3": ok("w3")},
                        FakeIndex({"w1": 8, "w2": 4}), migration_limit=2)
    outs = asyncio.run(collect(router.generate(GenerateInput(None, PROMPT, SamplingParams(max_tokens=5)))))
    assert [o.token_ids for o in outs] == [[7], [8], [7], [8]]
    third = pool.requests[2]
    assert list(third.prompt_token_ids) == PROMPT + [7, 8] and third.sampling.max_tokens == 3
    assert third.request_id.endswith(".m2")


def test_a_stream_longer_than_the_migration_length_is_not_migrated():
    router, pool = make({"w1": [WorkerChunk([7]), WorkerChunk([8]), err(Failure.UNAVAILABLE)], "w2": ok("w2")},
                        FakeIndex({"w1": 8}), migration_max_seq_len=len(PROMPT) + 1)
    with pytest.raises(Unavailable, match="longer than --migration-max-seq-len"):
        asyncio.run(collect(router.generate(GenerateInput(None, PROMPT, SamplingParams(max_tokens=4)))))
    assert pool.calls == ["w1"]


def test_every_worker_busy_is_resource_exhausted_and_down_is_unavailable():
    router, pool = make({"w1": [err(Failure.BUSY)], "w2": [err(Failure.BUSY)]})
    with pytest.raises(ResourceExhausted, match="every worker tried is at capacity"):
        run(router)
    assert sorted(pool.calls) == ["w1", "w2"]
    router, pool = make({f"w{i}": [err(Failure.UNAVAILABLE)] for i in range(5)}, max_attempts=3)
    with pytest.raises(Unavailable, match="no worker could take the request after 3 attempt"):
        run(router)
    assert len(pool.calls) == 3


def test_no_worker_and_bad_prompts():
    router, _ = make({})
    with pytest.raises(Unavailable, match="no worker is available for model 'm'"):
        run(router)
    router, _ = make({"w1": ok("w1")})
    cases = [(GenerateInput(None, [], SamplingParams()), "token_ids is empty"),
             (GenerateInput("", None, SamplingParams()), "text is empty"),
             (GenerateInput(None, None, SamplingParams()), "set text, token_ids or chat"),
             (GenerateInput("hi", None, SamplingParams()), "no tokenizer"),
             (GenerateInput(None, [2**32] * 4, SamplingParams()), r"token_ids\[0\] is 4294967296: token ids are integers in \[0, 2\*\*31\)")]
    for inp, message in cases:
        with pytest.raises(InvalidArgument, match=message):
            asyncio.run(collect(router.generate(inp)))


def test_burst_of_same_prefix_follows_the_first_before_events_land():
    router, pool = make({f"w{i}": ok(f"w{i}") for i in range(4)})
    for _ in range(5):
        run(router)
    assert len(set(pool.calls)) == 1  # the index never learned the blocks; the speculative map did
    other = [p + 100 for p in PROMPT]
    run(router, other)  # and it only pulls same-prefix requests
    assert router.speculative.matches(CHAIN) == {pool.calls[0]: 8}


def test_index_down_routes_by_rendezvous_and_never_fails_the_request():
    router, pool = make({f"w{i}": ok(f"w{i}") for i in range(4)}, FakeIndex(down=True), speculative_ttl_s=0)
    plan, decision = asyncio.run(router.decide(GenerateInput(None, PROMPT, SamplingParams())))
    assert (plan.query.index_ok, decision.reason) == (False, "fallback")
    firsts = {run(router)[-1].served_by for _ in range(3)}
    assert firsts == {decision.worker_id}


def test_cancelling_the_request_task_cancels_the_open_call_and_frees_inflight():
    router, pool = make({"w1": [WorkerChunk([7]), "hang"]})

    async def scenario() -> tuple:
        first = asyncio.Event()

        async def read() -> None:
            async for _ in router.generate(GenerateInput(None, PROMPT, SamplingParams())):
                first.set()

        task = asyncio.create_task(read())
        await first.wait()
        during = (pool.last_call.cancelled, router.inflight.view("w1"))
        task.cancel()  # what grpc.aio does to the servicer when the client goes away
        with pytest.raises(asyncio.CancelledError):
            await task
        return during, pool.last_call.cancelled, router.inflight.view("w1")

    assert asyncio.run(scenario()) == ((False, (1, 0)), True, (0, 0))


def test_worker_silent_past_first_token_timeout_is_retried_elsewhere():
    router, pool = make({"w1": ["hang"], "w2": ok("w2")}, FakeIndex({"w1": 8}), first_token_timeout_s=0.05)
    assert run(router)[-1].served_by == "w2"
    assert pool.calls == ["w1", "w2"]
    assert router.metrics.retries.labels("timeout")._value.get() == 1
    assert router.inflight.view("w1") == (0, 0)
    assert pool.unhealthy == set()  # NOTE: a slow reply is no reason to drop a worker (for anyone)
