"""The device and dtype of the token-exact tests, and their oracle.

Every token-exact test runs the engine in float32 on ``ENGINE_DEVICE`` (CUDA where the machine
has it, else the CPU) and compares its greedy tokens with transformers ``generate`` in float32 on
the CPU: the same dtype on both sides, so a CUDA run checks the CUDA path (Triton kernels, CUDA
graphs, the compiled forward) against the same oracle as a CPU run. Pass ``**EXACT`` to every
engine such a test builds, and ``EXACT_CLI`` to every ``kvmesh`` command it runs.
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path

import torch

ENGINE_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXACT = {"device": ENGINE_DEVICE, "dtype": "float32"}
"""Engine keyword arguments of every token-exact test."""
EXACT_CLI = ["--device", ENGINE_DEVICE, "--dtype", "float32"]
"""The same as ``kvmesh offline`` / ``kvmesh worker`` flags."""
ORACLE = "transformers generate, greedy, float32, CPU"

KVMESH = [sys.executable, "-m", "kvmesh.cli"]
"""The kvmesh command (without relying on the console script, which a source checkout lacks)."""


@cache
def hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run exactly max_new_tokens, like ignore_eos
    return model


def hf_greedy(model_dir: Path | str, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The oracle's tokens for one prompt."""
    with torch.inference_mode():
        out = hf_model(str(model_dir)).generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


def random_prompt(n: int, seed: int, vocab: int = 600) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (n,), generator=g).tolist()


def assert_matches_hf(model_dir: Path, outputs, max_new_tokens: int) -> None:
    """Every output's tokens are the oracle's greedy tokens for its prompt."""
    for i, out in enumerate(outputs):
        assert out.token_ids == hf_greedy(model_dir, out.prompt_token_ids, max_new_tokens), f"prompt {i}"


def worker_generate(worker, prompt: list[int], max_tokens: int = 6, rid: str = "", kv_transfer=None,
                    salt: str = "") -> tuple[list[int], object]:
    """One Generate straight to a worker's gRPC server (P/D legs included); (tokens, last message)."""
    from kvmesh.transport.channels import dial
    from kvmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

    stub = worker_pb2_grpc.WorkerStub(dial(worker.address))
    req = worker_pb2.WorkerGenerateRequest(request_id=rid, prompt_token_ids=prompt, cache_salt=salt,
                                           sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    if kv_transfer is not None:
        req.kv_transfer.CopyFrom(kv_transfer)
    out, last = [], None
    for m in stub.Generate(req, timeout=60):
        out += list(m.token_ids)
        last = m
    return out, last
