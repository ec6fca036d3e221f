"""Sampler scenarios on hand-made logits, plus stop ids and seeds through the engine."""

from __future__ import annotations

import pytest
import torch

from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.engine.llm import LLM
from kvmesh.model_worker.execution.sampler import Sampler
from tests.support.model_worker import EXACT


def logits_rows(n: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_rows_take_the_argmax() -> None:
    logits = logits_rows(4)
    tokens = Sampler().sample(logits, [SamplingParams()] * 4, ["a", "b", "c", "d"])
    assert tokens == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=1.5, top_k=1), SamplingParams(temperature=1.5, top_p=1e-6)],
    ids=["top_k=1", "tiny top_p"],
)
def test_degenerate_filters_equal_greedy(params: SamplingParams) -> None:
    logits = logits_rows(6, seed=1)
    sampler = Sampler(seed=3)
    for _ in range(5):
        assert sampler.sample(logits, [params] * 6, list("abcdef")) == logits.argmax(-1).tolist()


def test_top_k_keeps_only_the_k_best() -> None:
    logits = logits_rows(1, seed=2)
    top2 = set(logits[0].topk(2).indices.tolist())
    sampler = Sampler(seed=0)
    params = [SamplingParams(temperature=5.0, top_k=2)]
    seen = {sampler.sample(logits, params, ["r"])[0] for _ in range(200)}
    assert seen == top2  # both drawn at temperature 5, nothing else ever


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two (0.5 < 0.7 <= 0.8).
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    sampler = Sampler(seed=0)
    seen = {
        sampler.sample(logits, [SamplingParams(temperature=1.0, top_p=0.7)], ["r"])[0] for _ in range(300)
    }
    assert seen == {0, 1}


def test_seeded_request_is_reproducible_whatever_the_batch() -> None:
    logits = logits_rows(3, seed=4)
    seeded = SamplingParams(temperature=1.0, seed=1234)
    alone = Sampler(seed=0)
    batched = Sampler(seed=99)
    draws_alone = [alone.sample(logits[1:2], [seeded], ["x"])[0] for _ in range(20)]
    other = SamplingParams(temperature=1.0)
    draws_batched = [batched.sample(logits, [other, seeded, other], ["o1", "x", "o2"])[1] for _ in range(20)]
    assert draws_alone == draws_batched
    assert len(set(draws_alone)) > 1  # it really samples


def test_release_restarts_a_seeded_stream() -> None:
    logits = logits_rows(1, seed=5)
    params = [SamplingParams(temperature=1.0, seed=7)]
    sampler = Sampler()
    first = [sampler.sample(logits, params, ["r"])[0] for _ in range(10)]
    sampler.release("r")
    assert [sampler.sample(logits, params, ["r"])[0] for _ in range(10)] == first


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir("llama")), num_blocks=64, max_model_len=256, **EXACT)


def test_engine_seed_reproducible_and_seed_dependent(llm: LLM) -> None:
    prompt = [[5, 6, 7, 8, 9]]
    a = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True))
    b = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=11, ignore_eos=True))
    c = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=12, ignore_eos=True))
    assert a[0].token_ids == b[0].token_ids
    assert a[0].token_ids != c[0].token_ids


def test_stop_token_ends_the_request_and_is_kept(llm: LLM) -> None:
    prompt = [[40, 41, 42, 43]]
    (free,) = llm.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    stop = free.token_ids[5]
    cut = free.token_ids.index(stop)
    (stopped,) = llm.generate(prompt, SamplingParams(max_tokens=12, stop_token_ids=[stop], ignore_eos=True))
    assert stopped.token_ids == free.token_ids[: cut + 1]
    assert stopped.finish_reason == "stop"
    assert free.finish_reason == "length" and len(free.token_ids) == 12
