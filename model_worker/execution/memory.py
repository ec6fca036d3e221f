"""A worker's share of its GPU: ``--memory-fraction`` of the device, independent of other processes.

As vLLM's ``--gpu-memory-utilization``: the fraction is this worker's budget for everything it
holds (weights, activations, CUDA graphs, KV cache), taken of the device's total. It must be free
when the worker starts; what it does not spend on the rest is its KV cache. Two workers at 0.4
on one GPU each get 0.4 of it, whatever the other holds; a worker whose share is not free refuses
to start and says how much is free and what to set.

The arithmetic is pure (tested with a device's numbers injected, tests/model_worker/execution/test_memory.py);
``DeviceMemory.read`` asks the driver.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GiB = 2**30


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """The device as the worker finds it at start, before it loads anything."""

    total: int
    """Bytes of device memory."""
    free: int
    """Bytes free (the driver's count: other processes and this one's CUDA context hold the rest)."""

    @classmethod
    def read(cls, device: torch.device) -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(device)
        return cls(total=total, free=free)


def worker_share(mem: DeviceMemory, fraction: float) -> int:
    """Bytes this worker may hold: ``fraction`` of the device.

    Raises:
        ValueError: that much is not free; the message says how much is and what to set.
    """
    share = int(mem.total * fraction)
    if share > mem.free:
        # NOTE: rounded down to a hundredth, so the suggestion fits in what is free.
        most = math.floor(100 * mem.free / mem.total) / 100
        hint = (f"set --memory-fraction {most:.2f} or less" if most > 0
                else "free the device (every byte of it is held)")
        raise ValueError(
            f"--memory-fraction {fraction:g} asks for {share / GiB:.1f} GiB of this GPU's {mem.total / GiB:.1f} GiB, "
            f"but only {mem.free / GiB:.1f} GiB are free (other processes hold {(mem.total - mem.free) / GiB:.1f} GiB); "
            f"{hint}, or stop what holds the rest")
    return share


def kv_cache_budget(share: int, *, weights: int, activations: int, graphs: int, other: int = 0) -> int:
    """Bytes of the share left for the KV cache (may be negative: the caller says what to change).

    Args:
        share: :func:`worker_share`.
        weights: what the loaded model holds.
        activations: the reserve for one step's activations.
        graphs: the reserve for the CUDA graphs' memory pool and static buffers.
        other: anything else this process has taken since its start (library workspaces).
    """
    return share - weights - activations - graphs - other


def activation_reserve(num_tokens: int, hidden_size: int, intermediate_size: int) -> int:
    """A bound on one step's activations for ``num_tokens`` tokens (float32-sized, fused gate/up
    output, a few hidden-sized temporaries, with a factor for the allocator's rounding)."""
    return num_tokens * 4 * (2 * intermediate_size + 4 * hidden_size) * 4


def graph_reserve(max_batch: int, hidden_size: int, intermediate_size: int, vocab_size: int) -> int:
    """The decode graphs' pool (the largest batch's activations and logits) and static logits."""
    if max_batch == 0:
        return 0
    return activation_reserve(max_batch, hidden_size, intermediate_size) + 2 * max_batch * vocab_size * 4
