"""Greedy outputs of our engine are token-exact with transformers ``generate``: the engine in float32
on ``ENGINE_DEVICE``, the oracle in float32 on the CPU (tests/support/model_worker.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvmesh.contract.types import SamplingParams
from kvmesh.model_worker.config import ModelConfig
from kvmesh.model_worker.engine.llm import LLM
from tests.support.model_worker import EXACT, assert_matches_hf, random_prompt

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def make_llm(model_dir: Path, **kwargs) -> LLM:
    kwargs = {"num_blocks": 64, "max_model_len": 256, "max_num_batched_tokens": 256, **EXACT, **kwargs}
    return LLM(str(model_dir), **kwargs)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "llama3"])
def test_mixed_batch_with_chunked_prefill_matches_hf(tiny_model_dir, arch: str) -> None:
    model_dir = tiny_model_dir(arch)
    # 100 and 70 tokens exceed the 48-token budget: their prefill is split over several steps,
    # while the short prompts decode in the same steps.
    prompts = [random_prompt(n, seed=n) for n in (100, 5, 70, 1, 33)]
    llm = make_llm(model_dir, max_num_batched_tokens=48)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.prompt_token_ids for o in outputs] == prompts
    assert all(o.finish_reason == "length" and len(o.token_ids) == 12 for o in outputs)
    assert_matches_hf(model_dir, outputs, 12)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_prefix_cache_hit_keeps_output_exact(tiny_model_dir, arch: str) -> None:
    model_dir = tiny_model_dir(arch)
    first = random_prompt(80, seed=7)
    second = first[:64] + random_prompt(21, seed=8)  # shares 4 full blocks of 16
    llm = make_llm(model_dir)
    (a,) = llm.generate([first], GREEDY)
    (b,) = llm.generate([second], GREEDY)
    assert a.cached_tokens == 0
    assert b.cached_tokens == 64
    assert_matches_hf(model_dir, [a, b], 12)


def test_preemption_keeps_output_exact(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("llama")
    # Four requests of 40 + 40 tokens want 20 blocks; 11 usable blocks force preemption.
    prompts = [random_prompt(40, seed=100 + i) for i in range(4)]
    llm = make_llm(model_dir, num_blocks=12, max_model_len=128)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_matches_hf(model_dir, outputs, 40)


def test_mistral_sliding_window_matches_hf_and_matters(tiny_model_dir, tmp_path: Path) -> None:
    model_dir = tiny_model_dir("mistral")
    assert ModelConfig.from_dir(model_dir).sliding_windows == [32, 32]
    prompts = [random_prompt(100, seed=21), random_prompt(90, seed=22)]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    windowed = make_llm(model_dir, max_num_batched_tokens=64).generate(prompts, params)
    assert_matches_hf(model_dir, windowed, 20)

    # The same weights with full attention give different tokens: the window is really applied.
    full_dir = tmp_path / "mistral-full"
    shutil.copytree(model_dir, full_dir)
    cfg = json.loads((full_dir / "config.json").read_text())
    cfg["sliding_window"] = None
    (full_dir / "config.json").write_text(json.dumps(cfg))
    full = make_llm(full_dir, max_num_batched_tokens=64).generate(prompts, params)
    assert [o.token_ids for o in full] != [o.token_ids for o in windowed]


def test_qwen2_ties_embeddings_and_uses_qkv_bias(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("qwen2")
    cfg = ModelConfig.from_dir(model_dir)
    assert (cfg.tie_word_embeddings, cfg.qkv_bias, cfg.o_bias) == (True, True, False)
    model = make_llm(model_dir).engine.runner.model
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.layers[0].self_attn.qkv_proj.bias.abs().sum() > 0


def test_qwen3_loads_its_per_head_query_and_key_norms(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("qwen3")
    cfg = ModelConfig.from_dir(model_dir)
    # 6 heads of 24 over a hidden size of 64: head_dim comes from config.json, not hidden / heads.
    assert (cfg.architecture, cfg.qk_norm, cfg.num_heads, cfg.head_dim) == ("Qwen3ForCausalLM", True, 6, 24)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.tie_word_embeddings) == (False, False, False)
    attn = make_llm(model_dir).engine.runner.model.layers[1].self_attn
    ckpt = load_file(model_dir / "model.safetensors")
    for norm in ("q_norm", "k_norm"):
        want = ckpt[f"model.layers.1.self_attn.{norm}.weight"]
        assert want.shape == (24,) and not torch.equal(want, torch.ones(24))  # random, not the init's ones
        assert torch.equal(getattr(attn, norm).weight, want)


QWEN3_0_6B = {  # Qwen/Qwen3-0.6B's config.json, as published
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def test_a_real_qwen3_config_parses_and_transformers_weights_load() -> None:
    cfg = ModelConfig.from_dict(QWEN3_0_6B)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size) == (16, 8, 128, 1024)
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.o_bias, cfg.tie_word_embeddings) == (True, False, False, True)
    assert (cfg.rope_theta, cfg.rms_norm_eps, cfg.sliding_windows[:2], cfg.dtype) == (1e6, 1e-6, [None, None],
                                                                                      torch.bfloat16)
    no_head_dim = {k: v for k, v in QWEN3_0_6B.items() if k != "head_dim"}
    assert ModelConfig.from_dict(no_head_dim).head_dim == 128  # Qwen3Config's default, not 1024 / 16
    windowed = ModelConfig.from_dict({**QWEN3_0_6B, "use_sliding_window": True, "sliding_window": 4096})
    assert windowed.sliding_windows == [None] * 28  # every layer below max_window_layers = 28: full
    windowed = ModelConfig.from_dict({**QWEN3_0_6B, "use_sliding_window": True, "sliding_window": 4096,
                                      "max_window_layers": 26})
    assert windowed.sliding_windows == [None] * 26 + [4096, 4096]

    # One layer of the real shapes: transformers' Qwen3 tensors (names and shapes) all find their place.
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvmesh.model_worker.execution.models import model_class

    small = {**QWEN3_0_6B, "num_hidden_layers": 1, "vocab_size": 256, "torch_dtype": "float32"}
    hf = Qwen3ForCausalLM(Qwen3Config(**{k: v for k, v in small.items() if k != "torch_dtype"}))
    ours = model_class(ModelConfig.from_dict(small))(ModelConfig.from_dict(small))
    ours.load_weights(hf.state_dict().items())
    assert torch.equal(ours.layers[0].self_attn.k_norm.weight, hf.model.layers[0].self_attn.k_norm.weight)


def test_llama3_rope_scaling_is_parsed(tiny_model_dir) -> None:
    cfg = ModelConfig.from_dir(tiny_model_dir("llama3"))
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "llama3"
    assert cfg.rope_scaling["original_max_position_embeddings"] == 64
