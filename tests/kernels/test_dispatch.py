"""Backend dispatch: a pure decision of (device type, env), checked without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvmesh import kernels
from kvmesh.kernels.dispatch import BACKEND_ENV, attention_backend, resolve_attention_backend

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("device_type", "requested", "interpret", "expected"),
    [
        ("cuda", "auto", False, "triton"),
        ("cpu", "auto", False, "torch"),
        ("cpu", "auto", True, "torch"),  # auto never serves with the interpreter
        ("mps", "auto", False, "torch"),
        ("cuda", "torch", False, "torch"),
        ("cpu", "TORCH", False, "torch"),
        ("cuda", "triton", False, "triton"),
        ("cpu", "triton", True, "triton"),
        ("cuda", "", False, "triton"),  # an empty env value means auto
    ],
)
def test_decision_table(device_type, requested, interpret, expected):
    assert resolve_attention_backend(device_type, requested, interpret) == expected


def test_auto_on_cuda_without_triton_falls_back_to_torch():
    assert resolve_attention_backend("cuda", "auto", triton_available=False) == "torch"
    with pytest.raises(ValueError, match="not installed"):
        resolve_attention_backend("cuda", "triton", triton_available=False)


def test_forcing_triton_on_cpu_without_interpreter_explains_itself():
    with pytest.raises(ValueError, match=r"TRITON_INTERPRET=1 before triton is imported"):
        resolve_attention_backend("cpu", "triton", triton_interpret=False)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="expected one of auto, triton, torch"):
        resolve_attention_backend("cuda", "flash")


def test_attention_backend_reads_the_environment(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert attention_backend(torch.device("cpu")) == "torch"
    assert attention_backend("cuda:0") == "triton"  # a device object needs no GPU to exist
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert attention_backend("cuda") == "torch"
    monkeypatch.setenv(BACKEND_ENV, "triton")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        attention_backend("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert attention_backend("cpu") == "triton"


def test_public_entry_points_use_the_torch_path_on_cpu(monkeypatch):
    """kernels.* route CPU tensors to the torch path under auto (no triton needed): attention to
    kernels/torch_attention.py (tested against the reference), the KV write to the reference."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    calls: list[str] = []
    monkeypatch.setattr(kernels, "ragged_paged_attention_torch", lambda *a, **k: calls.append("attn"))
    monkeypatch.setattr(kernels, "write_kv_cache_ref", lambda *a, **k: calls.append("write"))
    q = torch.zeros(1, 1, 8)
    cache = torch.zeros(1, 4, 1, 8)
    i32 = torch.zeros(1, dtype=torch.int32)
    kernels.ragged_paged_attention(
        q, cache, cache, torch.tensor([0, 1], dtype=torch.int32), i32, i32[None], 1.0
    )
    kernels.write_kv_cache(q, q, cache, cache, i32)
    assert calls == ["attn", "write"]


def test_cpu_engine_path_never_imports_triton():
    """A CPU process using kernels.* under auto must not pay for (or depend on) importing triton."""
    code = (
        "import sys, torch\nfrom kvmesh import kernels\n"
        "q = torch.randn(2, 2, 8); cache = torch.randn(2, 4, 1, 8)\n"
        "i32 = lambda *v: torch.tensor(v, dtype=torch.int32)\n"
        "kernels.write_kv_cache(q[:, :1], q[:, :1], cache, cache, i32(0, 1))\n"
        "kernels.ragged_paged_attention(q, cache, cache, i32(0, 2), i32(2), i32(0)[None], 1.0)\n"
        "print('triton' in sys.modules)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in (BACKEND_ENV, "TRITON_INTERPRET")}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True, cwd=REPO_ROOT
    )
    assert result.stdout.strip() == "False"
