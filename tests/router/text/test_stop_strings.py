"""Stop strings on text deltas (router/text/stop_strings.py) and in the request path (router/model_router.py)."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.contract.errors import InvalidArgument
from kvmesh.contract.types import SamplingParams, Usage
from kvmesh.make_model import train_tokenizer
from kvmesh.router.config import RouterConfig, RoutingConfig
from kvmesh.router.core.policies.base import PolicyConfig
from kvmesh.router.core.upstream import WorkerChunk
from kvmesh.router.generate_types import GenerateInput
from kvmesh.router.model_router import ModelRouter
from kvmesh.router.text.stop_strings import StopStrings, check_stop_strings
from tests.support.router import FakeIndex, FakePool, collect


def feed(stops: StopStrings, deltas: list[str]) -> list[str]:
    return [stops.push(d) for d in deltas]


def test_text_ends_before_the_first_stop_and_nothing_after_it_is_released():
    s = StopStrings(["END", "\n\n"])
    assert feed(s, ["hello ", "wor", "ld E", "N", "Dmore", "x"]) == ["hello ", "wor", "ld ", "", "", ""]
    assert s.matched == "END" and s.flush() == ""


def test_held_text_is_released_when_it_turns_out_to_start_no_stop():
    s = StopStrings(["END"])
    assert feed(s, ["a E", "Nx", "y"]) == ["a ", "ENx", "y"]
    assert s.matched is None
    s = StopStrings(["stop here"])
    assert feed(s, ["x stop h"]) == ["x "] and s.flush() == "stop h"


def test_first_completed_stop_wins_and_include_keeps_it():
    s = StopStrings(["bc", "abcd"], include=True)
    assert feed(s, ["xab", "c", "d"]) == ["x", "abc", ""] and s.matched == "bc"
    # Completed by the same delta: the one that starts first.
    s = StopStrings(["bc", "abcd"], include=True)
    assert feed(s, ["xab", "cd"]) == ["x", "abcd"] and s.matched == "abcd"


def test_bounds():
    check_stop_strings(["a"] * 16)
    for bad in (["a"] * 17, [""], ["x" * 257]):
        with pytest.raises(ValueError):
            check_stop_strings(bad)


class AbortablePool(FakePool):
    """A worker that ends an aborted request with its usage, as the real worker does."""

    def __init__(self, scripts) -> None:
        super().__init__(scripts)
        self.aborted: list[str] = []

    async def abort(self, endpoint, request_id: str) -> bool:
        self.aborted.append(request_id)
        return True


def test_a_stop_string_ends_the_request_aborts_the_worker_and_keeps_its_usage():
    tok = train_tokenizer()
    ids = tok.encode(" the cat sat on the mat and the dog", add_special_tokens=False).ids
    script = [WorkerChunk([t]) for t in ids] + [WorkerChunk([], "abort", Usage(0, 16, 5), "w1")]
    pool = AbortablePool({"w1": script})
    router = ModelRouter(RouterConfig(routing=RoutingConfig(policy_config=PolicyConfig(seed=0))), pool, FakeIndex(), tok)
    inp = GenerateInput(None, list(range(1, 33)), SamplingParams(max_tokens=50), stop=[" on"])
    out = asyncio.run(collect(router.generate(inp)))
    assert "".join(o.text for o in out) == " the cat sat"
    last = out[-1]
    assert last.finish_reason == "stop" and len(pool.aborted) == 1
    # Tokens up to the one that completed " on"; the prompt's cached count is the worker's.
    n = sum(len(o.token_ids) for o in out)
    assert tok.decode(ids[:n]).endswith(" on") and not tok.decode(ids[:n - 1]).endswith(" on")
    assert last.usage == Usage(32, 16, n)
    assert router.inflight.view("w1") == (0, 0)


def test_stop_strings_need_a_tokenizer():
    router = ModelRouter(RouterConfig(routing=RoutingConfig(policy_config=PolicyConfig(seed=0))), FakePool({}), FakeIndex())
    with pytest.raises(InvalidArgument, match="stop strings need the model's tokenizer"):
        asyncio.run(collect(router.generate(GenerateInput(None, [1, 2], SamplingParams(), stop=["x"]))))
