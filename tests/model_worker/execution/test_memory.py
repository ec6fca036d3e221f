"""A worker's share of its GPU (memory.py), with an H200's numbers injected: no GPU needed."""

from __future__ import annotations

import pytest

from kvmesh.model_worker.execution.memory import (
    DeviceMemory,
    GiB,
    activation_reserve,
    graph_reserve,
    kv_cache_budget,
    worker_share,
)

MiB = 2**20
H200 = 143_771 * MiB
"""What torch.cuda.mem_get_info reported as total on the project's H200 (notes/gpu_h200.md)."""
CONTEXT = 520 * MiB
"""A CUDA context: what a worker holds before it loads anything."""
WEIGHTS_1B = 3_000 * MiB
"""The 1.5B-parameter Llama shape in bf16."""


def start_worker(free: int, fraction: float) -> int:
    """What a worker holds once it serves: its share (weights, activations, graphs, KV)."""
    share = worker_share(DeviceMemory(total=H200, free=free), fraction)
    budget = kv_cache_budget(share, weights=WEIGHTS_1B, activations=activation_reserve(2048, 2048, 8192),
                             graphs=graph_reserve(128, 2048, 8192, 128_256))
    assert budget > 0
    return share


def test_two_workers_at_0_4_on_one_gpu_both_start_and_get_the_same_kv_budget() -> None:
    free = H200 - CONTEXT
    first = start_worker(free, 0.4)
    free -= first + CONTEXT  # the second sees the first's share and both contexts as taken
    second = start_worker(free, 0.4)
    assert first == second == int(H200 * 0.4)
    # The old rule (total x fraction - everything in use) left the second nothing:
    # the first run's "KV cache budget (-24 MiB)".
    assert int(H200 * 0.4) - (H200 - free) - WEIGHTS_1B < 0


def test_a_share_that_is_not_free_is_refused_with_what_is_free_and_what_to_set() -> None:
    free = H200 - 2 * (int(H200 * 0.4) + CONTEXT) - CONTEXT  # two workers at 0.4 already
    with pytest.raises(ValueError) as err:
        worker_share(DeviceMemory(total=H200, free=free), 0.4)
    msg = str(err.value)
    assert "--memory-fraction 0.4 asks for 56.2 GiB of this GPU's 140.4 GiB" in msg
    assert f"only {free / GiB:.1f} GiB are free" in msg
    assert "set --memory-fraction 0.18 or less" in msg
    # ... and what it suggests starts.
    assert worker_share(DeviceMemory(total=H200, free=free), 0.18) == int(H200 * 0.18)


def test_a_full_device_says_so() -> None:
    with pytest.raises(ValueError, match="free the device"):
        worker_share(DeviceMemory(total=H200, free=H200 // 200), 0.5)


def test_the_kv_budget_is_the_share_less_what_else_the_worker_holds() -> None:
    share = 10 * GiB
    assert kv_cache_budget(share, weights=3 * GiB, activations=GiB, graphs=GiB // 2, other=GiB // 4) == \
        share - 3 * GiB - GiB - GiB // 2 - GiB // 4
    # Activations: 2048 tokens x 4 bytes x (2 x 8192 + 4 x 2048) x 4 = 768 MiB for the 1B shape.
    assert activation_reserve(2048, 2048, 8192) == 768 * MiB
    assert graph_reserve(0, 2048, 8192, 128_256) == 0
    assert graph_reserve(128, 2048, 8192, 128_256) == 48 * MiB + 2 * 128 * 128_256 * 4
