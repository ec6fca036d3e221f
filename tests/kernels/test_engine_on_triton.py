"""The whole engine on the Triton kernels: greedy tokens equal transformers' and the CPU path's.

Without CUDA the kernels run on the interpreter (slow, so the model and batch are tiny); with
CUDA the same test runs them compiled on the GPU, in float32 so the transformers oracle (CPU,
float32) applies. It checks what the kernel tests cannot: the model's strided q/k/v views (one
rotary pass over the fused projection), the runner's metadata and chunked prefill through the
kernels the GPU path uses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmesh.contract.types import SamplingParams
from kvmesh.kernels.attention_configs import SERVED_HEAD_SHAPES
from kvmesh.make_model import ModelSpec, make_model
from kvmesh.model_worker.engine.llm import LLM
from tests.support.kernels import import_kernel_module

HAS_CUDA = torch.cuda.is_available()
pytestmark = pytest.mark.usefixtures("interpreter_env")

triton_attention = import_kernel_module("kvmesh.kernels.triton_attention", "_ragged_paged_attention_kernel")
import_kernel_module("kvmesh.kernels.triton_kv_write", "_write_kv_cache_kernel")


def _hf_greedy(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_engine_on_triton_kernels_matches_hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    model_dir = make_model(tmp_path / "m", ModelSpec(layers=2, hidden_size=64, heads=4, kv_heads=2,
                                                     intermediate_size=128, max_position_embeddings=256,
                                                     seed=5, init_std=0.05))
    gen = torch.Generator().manual_seed(3)
    # 37 tokens over a 24-token budget: a prefill chunk after earlier tokens, next to a decode.
    prompts = [torch.randint(2, 600, (n,), generator=gen).tolist() for n in (37, 6)]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    kw = {"num_blocks": 32, "block_size": 8, "max_model_len": 128, "max_num_batched_tokens": 24,
          "dtype": "float32", "device": "cuda" if HAS_CUDA else "cpu"}

    monkeypatch.setenv("KVMESH_ATTENTION_BACKEND", "torch")
    torch_outs = [o.token_ids for o in LLM(str(model_dir), **kw).generate(prompts, params)]
    monkeypatch.setenv("KVMESH_ATTENTION_BACKEND", "triton")
    calls: list[int] = []
    real = triton_attention.ragged_paged_attention_triton
    monkeypatch.setattr(triton_attention, "ragged_paged_attention_triton",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    triton_outs = [o.token_ids for o in LLM(str(model_dir), **kw).generate(prompts, params)]

    assert len(calls) >= 2 * 4  # every layer of every step went through the Triton kernel
    assert triton_outs == torch_outs
    assert triton_outs == [_hf_greedy(model_dir, p, 4) for p in prompts]


SHAPE_IDS = [f"{hq}-{hkv}x{d}" for hq, hkv, d in SERVED_HEAD_SHAPES]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), SERVED_HEAD_SHAPES, ids=SHAPE_IDS)
def test_every_served_head_shape_through_the_engine_matches_hf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              heads: int, kv_heads: int, head_dim: int) -> None:
    """One layer of each head shape kvmesh serves (a narrow hidden size, the real heads): the engine
    on the Triton kernels gives transformers' greedy tokens for a chunked prompt beside a short one."""
    torch.set_num_threads(1)
    model_dir = make_model(tmp_path / "m", ModelSpec(layers=1, hidden_size=4 * heads, heads=heads, kv_heads=kv_heads,
                                                     intermediate_size=64, max_position_embeddings=128, seed=heads,
                                                     init_std=0.05, extra_config={"head_dim": head_dim}))
    gen = torch.Generator().manual_seed(head_dim + heads)
    prompts = [torch.randint(2, 600, (n,), generator=gen).tolist() for n in (21, 5)]
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    kw = {"num_blocks": 16, "block_size": 8, "max_model_len": 64, "max_num_batched_tokens": 16,
          "dtype": "float32", "device": "cuda" if HAS_CUDA else "cpu"}
    monkeypatch.setenv("KVMESH_ATTENTION_BACKEND", "triton")
    outs = [o.token_ids for o in LLM(str(model_dir), **kw).generate(prompts, params)]
    assert outs == [_hf_greedy(model_dir, p, 3) for p in prompts]


def test_a_head_shape_the_kernel_cannot_run_is_refused_at_start(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A head dim past the kernel's bound: the engine refuses before loading anything, naming the
    shape, the limit and the way out; the torch backend serves the same model."""
    model_dir = make_model(tmp_path / "m", ModelSpec(layers=1, hidden_size=64, heads=2, kv_heads=1,
                                                     intermediate_size=64, max_position_embeddings=64,
                                                     extra_config={"head_dim": 320}))
    kw = {"num_blocks": 8, "block_size": 8, "max_model_len": 32, "dtype": "float32",
          "device": "cuda" if HAS_CUDA else "cpu"}
    monkeypatch.setenv("KVMESH_ATTENTION_BACKEND", "triton")
    with pytest.raises(ValueError, match=r"cannot run this model's heads \(2 query / 1 KV x 320\): head dim 320 "
                                         r"\(it runs 1-256\); serve it with KVMESH_ATTENTION_BACKEND=torch"):
        LLM(str(model_dir), **kw)
    monkeypatch.setenv("KVMESH_ATTENTION_BACKEND", "torch")
    assert len(LLM(str(model_dir), **kw).generate([[5, 6, 7]], SamplingParams(max_tokens=2))[0].token_ids) == 2
