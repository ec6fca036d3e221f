"""The host KV tier in the whole engine: a prompt's prefix served from the device, from the host
tier (loaded back) or recomputed gives transformers' greedy tokens, token for token.

On CPU the two pools are both host memory (one code path, synchronous copies); the same tests run
on CUDA where a GPU is present (pinned host tier, copy stream), in float32 so the CPU transformers
oracle applies.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.engine.llm import LLM
from kvmesh.model_worker.engine.llm_engine import LLMEngine
from tests.support.model_worker import hf_greedy, random_prompt

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs an NVIDIA GPU with CUDA")])]


def make_llm(model_dir: Path, device: str, **kwargs) -> LLM:
    # 11 usable blocks of 16 = 176 tokens: two 90-token prompts evict everything before them.
    kw = {"num_blocks": 12, "max_model_len": 128, "max_num_batched_tokens": 64, "dtype": "float32",
          "device": device, **kwargs}
    return LLM(str(model_dir), **kw)


def hits(engine: LLMEngine) -> tuple[int, int]:
    s = engine.stats()
    return s.prefix_cache_hits, s.host_cache_hits


def generate(llm: LLM, prompt: list[int]) -> tuple[list[int], int, int]:
    """Tokens, cached tokens, and of those how many the host tier served."""
    _, host0 = hits(llm.engine)
    (out,) = llm.generate([prompt], GREEDY)
    return out.token_ids, out.cached_tokens, hits(llm.engine)[1] - host0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prefixes_from_device_host_and_recompute_are_token_exact(tiny_model_dir, arch: str, device: str) -> None:
    model_dir = tiny_model_dir(arch)
    shared = random_prompt(64, seed=11)  # four blocks of 16
    suffixes = [random_prompt(20, seed=20 + i) for i in range(5)]
    fill = [random_prompt(90, seed=40 + i) for i in range(2)]
    llm = make_llm(model_dir, device, host_kv_blocks=32)
    engine = llm.engine
    chain = engine.block_hasher.hash_prompt(shared)
    seen: dict[str, tuple[list[int], list[int]]] = {}  # case -> (prompt, tokens)

    tokens, cached, host = generate(llm, shared + suffixes[0])
    assert (cached, host) == (0, 0)
    seen["recomputed"] = (shared + suffixes[0], tokens)
    tokens, cached, host = generate(llm, shared + suffixes[1])
    assert (cached, host) == (64, 0)
    seen["device"] = (shared + suffixes[1], tokens)

    for p in fill:  # evict every block of the shared prefix from the device
        generate(llm, p)
    assert not set(chain) & engine.cached_block_hashes() and set(chain) <= engine.host_block_hashes()
    assert engine.stats().host_loaded_blocks == 0
    tokens, cached, host = generate(llm, shared + suffixes[2])
    assert (cached, host) == (64, 64)
    seen["host"] = (shared + suffixes[2], tokens)
    # the loads are counted and timed for the load reports (routers learn the link from them)
    s = engine.stats()
    assert s.host_loaded_blocks == 4 and s.host_load_s > 0
    assert engine.report_load().host_loaded_blocks == 4

    # Evict the shared prefix's tail blocks only (freed chains go tail first): one-block prompts
    # until its last block leaves the device while its first stays.
    i = 0
    while chain[-1] in engine.cached_block_hashes():
        generate(llm, random_prompt(17, seed=100 + i))
        i += 1
    assert chain[0] in engine.cached_block_hashes() and chain[-1] in engine.host_block_hashes()
    tokens, cached, host = generate(llm, shared + suffixes[3])
    assert cached == 64 and 0 < host < 64
    seen["device + host"] = (shared + suffixes[3], tokens)

    for case, (prompt, got) in seen.items():
        assert got == hf_greedy(model_dir, prompt, GREEDY.max_tokens), case

    # The same history without the tier recomputes what the tier loaded, with the same tokens.
    off = make_llm(model_dir, device)
    for p in [shared + suffixes[0], shared + suffixes[1], *fill]:
        generate(off, p)
    assert generate(off, seen["host"][0])[:2] == (seen["host"][1], 0)


@pytest.mark.parametrize("device", DEVICES)
def test_the_loaded_kv_is_what_the_step_reads(tiny_model_dir, device: str) -> None:
    """A control that the test above can fail: overwrite the host tier's copy of the prefix and
    the request served from it no longer gives transformers' tokens."""
    model_dir = tiny_model_dir("llama")
    shared, suffix = random_prompt(64, seed=11), random_prompt(20, seed=22)
    llm = make_llm(model_dir, device, host_kv_blocks=32)
    generate(llm, shared + random_prompt(20, seed=20))
    for i in range(2):
        generate(llm, random_prompt(90, seed=40 + i))
    host_kv = llm.engine.runner.host_kv
    host_kv.blocks.normal_(generator=torch.Generator().manual_seed(0))
    tokens, cached, host = generate(llm, shared + suffix)
    assert (cached, host) == (64, 64)
    assert tokens != hf_greedy(model_dir, shared + suffix, GREEDY.max_tokens)


def test_multi_step_decode_and_preemption_with_the_tier_stay_exact(tiny_model_dir) -> None:
    """Windows allocate lookahead blocks (which evict into the host tier) and preemption frees
    blocks mid-run; greedy tokens of every request still match transformers."""
    model_dir = tiny_model_dir("llama")
    shared = random_prompt(48, seed=5)
    prompts = [shared + random_prompt(8 + 3 * i, seed=60 + i) for i in range(6)]
    llm = make_llm(model_dir, "cpu", host_kv_blocks=24, num_scheduler_steps=4, max_num_batched_tokens=48)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = llm.generate(prompts[:3], params)
    # two long unrelated requests push the shared prefix out to the host tier between the waves
    for i in range(2):
        outs += llm.generate([random_prompt(100, seed=70 + i)], params)
    assert not set(llm.engine.block_hasher.hash_prompt(shared)) & llm.engine.cached_block_hashes()
    outs += llm.generate(prompts[3:], params)
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.stats().host_cache_hits > 0
    for o in outs:
        assert o.token_ids == hf_greedy(model_dir, o.prompt_token_ids, 24)


def test_bad_host_tier_settings_are_refused_with_the_flag_to_change(tiny_model_dir) -> None:
    model_dir = str(tiny_model_dir("llama"))
    for kwargs, message in [
        ({"host_kv_blocks": 8, "kv_offloading_size": 1.0}, "not both"),
        ({"host_kv_blocks": -1}, "--host-kv-blocks must be >= 0"),
        ({"kv_offloading_size": float("nan")}, "--kv-offloading-size must be"),
        ({"host_kv_blocks": 8, "enable_prefix_caching": False}, "needs prefix caching"),
        ({"kv_offloading_size": 1e-9}, "holds no KV block"),
        ({"host_kv_blocks": 1 << 40}, "more than the"),
    ]:
        with pytest.raises(ValueError, match=message):
            LLM(model_dir, num_blocks=16, max_model_len=128, **kwargs)
    with pytest.raises(ValueError, match="full attention in every layer"):
        LLM(str(tiny_model_dir("mistral")), num_blocks=64, max_model_len=128, host_kv_blocks=8)
    # A size in GiB becomes blocks of this model: 2 layers x 2 KV heads x 16 dims x K and V x fp32 x 16 tokens.
    llm = LLM(model_dir, num_blocks=16, max_model_len=128, kv_offloading_size=1 / 1024)
    assert llm.engine.stats().num_host_blocks == (1 << 20) // (2 * 2 * 16 * 2 * 4 * 16)
