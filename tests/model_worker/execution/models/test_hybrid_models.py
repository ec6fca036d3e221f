"""Windowed models through the hybrid allocator, greedy token-exact with transformers (the engine
in float32 on ``ENGINE_DEVICE``, the oracle in float32 on the CPU: tests/support/model_worker.py).

Mistral windows every layer (one sliding-window group); the interleaved Qwen2 keeps full
attention in layers 0-1 and windows 2-3 (``use_sliding_window`` + ``max_window_layers``: one
full-attention group and one sliding-window group). Prompts are several windows long, so blocks
leave the window during prefill and decode and are freed.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvmesh.contract.types import SamplingParams
from kvmesh.make_model import ModelSpec, make_model
from kvmesh.model_worker.engine.llm import LLM
from kvmesh.model_worker.scheduling.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from tests.model_worker.conftest import TINY
from tests.support.model_worker import EXACT, EXACT_CLI, KVMESH, assert_matches_hf, hf_greedy, random_prompt

PARAMS = SamplingParams(max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def qwen2_interleaved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = ModelSpec(
        arch="qwen2", **{**TINY, "layers": 4}, sliding_window=24, max_window_layers=2, seed=6, init_std=0.2
    )
    return make_model(tmp_path_factory.mktemp("qwen2-swa"), spec)


def test_mistral_pool_smaller_than_full_attention_needs_is_exact_and_drains(tiny_model_dir) -> None:
    model_dir = tiny_model_dir("mistral")  # window 32, blocks of 16: a hit needs 2 window blocks
    # 15 usable blocks hold 240 tokens: two 170-token requests fit only because the window frees
    # their early blocks (each holds at most ceil((31 + 32) / 16) + 1 = 5 blocks).
    llm = LLM(str(model_dir), num_blocks=16, max_model_len=256, max_num_batched_tokens=32, **EXACT)
    kv = llm.engine.kv_cache_manager
    assert [type(g.spec) for g in kv.kv_cache_config.groups] == [SlidingWindowSpec]
    prompts = [random_prompt(150, seed=31), random_prompt(130, seed=32)]
    outs = llm.generate(prompts, PARAMS)
    assert_matches_hf(model_dir, outs, 16)
    assert kv.num_free_blocks == 15 and all(b.ref_cnt == 0 for b in kv.block_pool.blocks)

    # A prompt sharing the first 128 tokens of prompt 0 hits 8 blocks through the window's last 2.
    (hit,) = llm.generate([prompts[0][:128] + random_prompt(20, seed=33)], PARAMS)
    assert hit.cached_tokens == 128
    assert_matches_hf(model_dir, [hit], 16)


def test_qwen2_interleaved_windows_are_exact_with_hits_and_chunked_prefill(qwen2_interleaved: Path) -> None:
    llm = LLM(str(qwen2_interleaved), num_blocks=64, max_model_len=256, max_num_batched_tokens=48, **EXACT)
    kv = llm.engine.kv_cache_manager
    assert [(type(g.spec), g.layer_ids) for g in kv.kv_cache_config.groups] == [
        (FullAttentionSpec, (0, 1)),
        (SlidingWindowSpec, (2, 3)),
    ]
    runner = llm.engine.runner
    assert runner.model.kv_group_of_layer == [0, 0, 1, 1]
    caches = runner.model.kv_caches()
    # Two tensor pairs shared by the groups: layer j of each group uses pair j.
    assert caches[0].k_cache is caches[2].k_cache and caches[1].k_cache is caches[3].k_cache
    assert caches[0].k_cache is not caches[1].k_cache

    first = random_prompt(120, seed=41)
    prompts = [first, random_prompt(100, seed=42), random_prompt(7, seed=43)]
    outs = llm.generate(prompts, PARAMS)
    assert_matches_hf(qwen2_interleaved, outs, 16)
    (hit,) = llm.generate([first[:96] + random_prompt(30, seed=44)], PARAMS)
    assert hit.cached_tokens == 96  # full group: 6 blocks; window group: blocks 4, 5
    assert_matches_hf(qwen2_interleaved, [hit], 16)
    assert kv.num_free_blocks == 63


def test_multistep_decode_over_sliding_windows_is_exact(qwen2_interleaved: Path) -> None:
    llm = LLM(str(qwen2_interleaved), num_blocks=64, max_model_len=256, num_scheduler_steps=4, **EXACT)
    outs = llm.generate([random_prompt(60, seed=51), random_prompt(75, seed=52)], SamplingParams(
        max_tokens=40, ignore_eos=True))
    assert_matches_hf(qwen2_interleaved, outs, 40)
    assert llm.engine.kv_cache_manager.num_free_blocks == 63


def _kvmesh(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([*KVMESH, *args], capture_output=True, text=True, env=env, timeout=300)


@pytest.mark.parametrize(
    ("arch", "flags"),
    [
        ("mistral", ["--sliding-window", "32"]),
        ("qwen2", ["--sliding-window", "24", "--max-window-layers", "2"]),
        ("qwen3", ["--sliding-window", "24", "--max-window-layers", "2", "--head-dim", "24"]),
    ],
)
def test_kvmesh_offline_on_windowed_checkpoints_matches_transformers(
    tmp_path: Path, arch: str, flags: list[str]
) -> None:
    model_dir = tmp_path / arch
    small = ["--layers", "4", "--hidden-size", "64", "--heads", "4", "--kv-heads", "2",
             "--intermediate-size", "128", "--max-position-embeddings", "512", "--init-std", "0.2"]
    done = _kvmesh("make-model", str(model_dir), "--arch", arch, *small, *flags)
    assert done.returncode == 0, done.stderr
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["sliding_window"] == int(flags[1])

    prompts = [random_prompt(110, seed=61), random_prompt(90, seed=62)]
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(
        json.dumps({"prompt_token_ids": p, "max_tokens": 12, "ignore_eos": True}) + "\n" for p in prompts
    ))
    done = _kvmesh("offline", "--model", str(model_dir), "--input", str(src), "--output", str(dst),
                   "--num-blocks", "48", "--max-num-batched-tokens", "32", *EXACT_CLI)
    assert done.returncode == 0, done.stderr
    got = [json.loads(line) for line in dst.read_text().splitlines()]
    for p, row in zip(prompts, got, strict=True):
        assert row["token_ids"] == hf_greedy(model_dir, p, 12)
