"""Tiny random checkpoints made once per session by kvmesh's make-model (fp32); the device and dtype
of the token-exact tests are in tests/support/model_worker.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvmesh.make_model import ModelSpec, make_model

TINY = dict(layers=2, hidden_size=64, heads=4, kv_heads=2, intermediate_size=128, max_position_embeddings=512)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # NOTE: small on purpose, so the scaling changes the frequencies our short prompts reach.
    "original_max_position_embeddings": 64,
}
SPECS = {
    "llama": ModelSpec(arch="llama", **TINY, seed=1, init_std=0.05),
    # NOTE: a tied head with std 0.02 repeats the input token forever; 0.2 gives varied output.
    "qwen2": ModelSpec(arch="qwen2", **TINY, seed=2, init_std=0.2),
    "mistral": ModelSpec(arch="mistral", **TINY, sliding_window=32, seed=3, init_std=0.05),
    # NOTE: 6 heads of 24 over a hidden size of 64: head_dim is not hidden_size / heads (as in Qwen3-0.6B).
    "qwen3": ModelSpec(arch="qwen3", **{**TINY, "heads": 6}, head_dim=24, seed=5, init_std=0.1),
    "llama3": ModelSpec(
        arch="llama", **TINY, seed=4, init_std=0.05, extra_config={"rope_parameters": LLAMA3_ROPE}
    ),
}


def pytest_report_header(config: pytest.Config) -> str:
    from tests.support.model_worker import ENGINE_DEVICE, ORACLE

    return f"token-exact tests: the engine in float32 on {ENGINE_DEVICE}; the oracle: {ORACLE}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_model_dir(name) -> Path`` for a name of SPECS; each model is made once."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = make_model(tmp_path_factory.mktemp(f"tiny-{name}"), SPECS[name])
        return made[name]

    return get


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    # NOTE: on a shared 2-core machine torch's intra-op threads spin against other processes and
    # tiny-model steps get ~50x slower; one thread keeps the tests fast and deterministic.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
