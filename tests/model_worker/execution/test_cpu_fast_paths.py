"""The CPU fast paths equal what they replace: oneDNN Linear, fused RMSNorm, the one-pass rotary;
the allocator settings; the engine's CPU thread count."""

from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F

from kvmesh.kernels.torch_attention import _prefix_then_causal
from kvmesh.model_worker.execution.cpu_threads import default_cpu_threads
from kvmesh.model_worker.execution.host_allocator import keep_freed_buffers
from kvmesh.model_worker.execution.models.layers import _ONEDNN_MIN_ROWS, Linear, RMSNorm, apply_rotary


@pytest.mark.parametrize("rows", [1, _ONEDNN_MIN_ROWS - 1, _ONEDNN_MIN_ROWS, 2048])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_equals_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    layer = Linear(96, 160, bias=bias)
    x = torch.randn(rows, 96)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_linear_takes_strided_inputs() -> None:
    layer = Linear(64, 48)
    x = torch.randn(300, 128)[:, ::2]  # a strided view, as a slice of a fused projection is
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


def test_linear_keeps_other_dtypes_on_f_linear() -> None:
    layer = Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(256, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_equals_the_hf_formula(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    norm = norm.to(dtype)
    x, residual = torch.randn(300, 64, dtype=dtype), torch.randn(300, 64, dtype=dtype)
    out, summed = norm(x, residual)
    h = (x + residual).float()
    want = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_rotary_equals_rotate_half() -> None:
    torch.manual_seed(0)
    x = torch.randn(50, 6, 32)
    angles = torch.rand(50, 1, 16) * 100
    cos, sin = angles.cos(), angles.sin()
    full_cos, full_sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    rotated = torch.cat((-x[..., 16:], x[..., :16]), dim=-1)
    torch.testing.assert_close(apply_rotary(x, cos, sin), x * full_cos + rotated * full_sin)


def test_prefix_then_causal_runs_on_this_torch() -> None:
    # NOTE: the fast path of a chunk after a prefix needs the CPU flash op's log-sum-exp; if a
    # torch upgrade drops it the engine silently takes the masked path, ~1.6x slower: fail here.
    q, k, v = torch.randn(8, 4, 16), torch.randn(20, 2, 16), torch.randn(20, 2, 16)
    assert _prefix_then_causal(q, k, v, 0.25) is not None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs glibc (Linux)")
def test_allocator_settings_take_on_glibc() -> None:
    assert keep_freed_buffers() is True
    assert keep_freed_buffers() is True  # idempotent


def test_cpu_threads_leave_one_core() -> None:
    assert [default_cpu_threads(n) for n in (1, 2, 4, 16)] == [1, 1, 3, 15]


def test_a_chosen_thread_count_is_kept_even_when_it_equals_torchs_default(monkeypatch):
    """`--torch-threads 2` on a 2-core machine is 2, not the engine's cores - 1 (it was 1: a choice
    equal to torch's default looked like no choice)."""
    from kvmesh.model_worker.execution import cpu_threads

    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "_CHOSEN_THREADS", False)
    monkeypatch.setattr(cpu_threads, "_TORCH_DEFAULT_THREADS", 3)
    monkeypatch.setattr(cpu_threads.os, "sched_getaffinity", lambda _pid: {0, 1, 2}, raising=False)
    try:
        torch.set_num_threads(3)
        cpu_threads.apply_cpu_threads()
        assert torch.get_num_threads() == 2  # no choice: every core but one
        cpu_threads.set_cpu_threads(3)
        cpu_threads.apply_cpu_threads()
        assert torch.get_num_threads() == 3  # chosen, though equal to torch's default
    finally:
        torch.set_num_threads(before)


def test_usable_cores_honour_a_cgroup_cpu_quota(tmp_path):
    """A pod limited to 2 CPUs on a bigger node must not start a thread per node core."""
    import os

    from kvmesh.model_worker.execution.cpu_threads import usable_cores

    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu_max = tmp_path / "cpu.max"
    cpu_max.write_text("max 100000\n")
    assert usable_cores(str(cpu_max)) == affinity
    cpu_max.write_text("50000 100000\n")  # half a CPU: still one thread
    assert usable_cores(str(cpu_max)) == 1
    cpu_max.write_text(f"{100000 * (affinity + 8)} 100000\n")  # a quota above the affinity
    assert usable_cores(str(cpu_max)) == affinity
    assert usable_cores(str(tmp_path / "missing")) == affinity
