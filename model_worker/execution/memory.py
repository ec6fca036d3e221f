"""A worker's share of its GPU: ``--memory-fraction`` of the device, independent of other processes.

As vLLM's ``--gpu-memory-utilization``: the fraction is this worker's budget for everything it
holds (weights, activations, CUDA graphs, KV cache, and its process's CUDA context), taken of the
device's total. What it does not hold yet must be free when the worker starts; what it does not
spend on the rest is its KV cache. Two workers at 0.4 on one GPU each get 0.4 of it, whatever the
other holds; a worker whose share is not free refuses to start and says how much is free and what
to set.

What the worker holds is counted from the CUDA driver's per-process figures (NVML's running
processes: this process's bytes on the device), never from the device's free memory: workers that
start at the same moment take memory during each other's start, and a device-wide count would
charge that to the wrong one (issue 43: "the KV cache budget (-3574 MiB) holds -7149 blocks").
Where the driver cannot say (no NVML, or a PID namespace that hides this process from it), it is
torch's own allocations since the start, and the log says what that leaves out.

The arithmetic is pure (tested with a device's numbers and two workers' interleaved starts injected,
tests/model_worker/execution/test_memory.py); ``DeviceMemory.read`` and :func:`process_memory` ask the driver.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

GiB = 2**30


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """The device as the worker finds it at start, before it loads anything."""

    total: int
    """Bytes of device memory."""
    free: int
    """Bytes free (the driver's count: other processes and this one's CUDA context hold the rest)."""
    process: int | None = None
    """Bytes this process holds on the device, by the driver's per-process count; None where it cannot say."""

    @classmethod
    def read(cls, device: torch.device) -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(device)
        return cls(total=total, free=free, process=process_memory(device))


def worker_share(mem: DeviceMemory, fraction: float, held: int = 0) -> int:
    """Bytes this worker may hold: ``fraction`` of the device, of which it holds ``held`` already
    (its process's CUDA context); the rest must be free.

    Raises:
        ValueError: that much is not free; the message says how much is and what to set.
    """
    share = int(mem.total * fraction)
    if share - held > mem.free:
        # NOTE: rounded down to a hundredth, so the suggestion fits in what is free.
        most = math.floor(100 * (mem.free + held) / mem.total) / 100
        hint = (f"set --memory-fraction {most:.2f} or less" if most > 0
                else "free the device (every byte of it is held)")
        raise ValueError(
            f"--memory-fraction {fraction:g} asks for {share / GiB:.1f} GiB of this GPU's {mem.total / GiB:.1f} GiB, "
            f"but only {mem.free / GiB:.1f} GiB are free (other processes hold {(mem.total - mem.free - held) / GiB:.1f} "
            f"GiB); {hint}, or stop what holds the rest")
    return share


@dataclass(frozen=True, slots=True)
class Footprint:
    """What one engine holds on its device, counted from its start by per-process figures only.

    Args:
        start: the device and this process at the engine's start.
        torch_reserved: torch's reserved bytes on the device at the start.
        counts_process: the first engine of its process on this device: it counts the process's
            memory from zero (the CUDA context is part of its share); a later engine counts only what
            it added (tests build several engines in one process).
    """

    start: DeviceMemory
    torch_reserved: int
    counts_process: bool

    @property
    def held_at_start(self) -> int:
        """What the share holds already at the start: the process's context, for its first engine."""
        if self.counts_process and self.start.process is not None:
            return self.start.process
        return 0

    def held(self, process_now: int | None, torch_reserved_now: int) -> int:
        """Bytes this engine holds now: the process's bytes since the start (plus its context, for
        the first engine) when the driver says, else torch's reserved bytes since the start."""
        if self.start.process is not None and process_now is not None:
            return process_now - self.start.process + self.held_at_start
        return torch_reserved_now - self.torch_reserved


def kv_cache_budget(share: int, *, held: int, activations: int, graphs: int) -> int:
    """Bytes of the share left for the KV cache (may be negative: the caller says what to change).

    Args:
        share: :func:`worker_share`.
        held: what the engine holds so far (:meth:`Footprint.held`: weights, static buffers, library
            workspaces, and its process's context for a process's first engine).
        activations: the reserve for one step's activations.
        graphs: the reserve for the CUDA graphs' memory pool and static buffers.
    """
    return share - held - activations - graphs


# -- the driver's per-process figure (NVML) ---------------------------------------------------------


class _ProcessInfo(ctypes.Structure):
    # nvmlProcessInfo_v2_t (NVML >= R470), what nvmlDeviceGetComputeRunningProcesses_v2 fills.
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


_NVML_ERROR_INSUFFICIENT_SIZE = 7
_NVML_VALUE_NOT_AVAILABLE = 2**64 - 1


def _nvml_processes(uuid: str) -> dict[int, int]:
    """pid -> bytes of every compute process on the device ``uuid``, from libnvidia-ml (the driver's)."""
    nvml = ctypes.CDLL("libnvidia-ml.so.1")
    if nvml.nvmlInit_v2() != 0:
        raise OSError("nvmlInit_v2 failed")
    try:
        handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)) != 0:
            raise OSError(f"NVML knows no device {uuid}")
        get = nvml.nvmlDeviceGetComputeRunningProcesses_v2
        count = ctypes.c_uint(0)
        rc = get(handle, ctypes.byref(count), None)
        for _ in range(3):  # processes may start between the two calls
            if rc not in (0, _NVML_ERROR_INSUFFICIENT_SIZE):
                raise OSError(f"nvmlDeviceGetComputeRunningProcesses_v2 returned {rc}")
            if rc == 0 and count.value == 0:
                return {}
            count = ctypes.c_uint(count.value + 8)
            infos = (_ProcessInfo * count.value)()
            rc = get(handle, ctypes.byref(count), infos)
            if rc == 0:
                return {i.pid: i.usedGpuMemory for i in infos[: count.value]
                        if i.usedGpuMemory != _NVML_VALUE_NOT_AVAILABLE}
        raise OSError("the process list kept growing")
    finally:
        nvml.nvmlShutdown()


def process_memory(device: torch.device, processes: Callable[[str], dict[int, int]] = _nvml_processes,
                   pid: int | None = None) -> int | None:
    """Bytes this process holds on ``device`` by the driver's per-process count, or None (logged)
    where the driver cannot say: no NVML, or this process is not in its list (a container's PID
    namespace: NVML lists the host's process ids)."""
    pid = os.getpid() if pid is None else pid
    try:
        uuid = f"GPU-{torch.cuda.get_device_properties(device).uuid}"
        used = processes(uuid)
    except (OSError, AttributeError, RuntimeError) as exc:
        _note_fallback(f"NVML cannot list the device's processes ({exc})")
        return None
    if pid not in used:
        # NOTE: a process that has touched the device is listed; absent, it runs in another PID namespace.
        _note_fallback(f"NVML does not list this process (pid {pid}; a PID namespace?)")
        return None
    return used[pid]


_WARNED: set[str] = set()


def _note_fallback(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        log.warning("%s: the KV cache budget counts torch's allocations since the worker's start, not the "
                    "CUDA context or libraries' memory outside torch", reason)


def activation_reserve(num_tokens: int, hidden_size: int, intermediate_size: int) -> int:
    """A bound on one step's activations for ``num_tokens`` tokens (float32-sized, fused gate/up
    output, a few hidden-sized temporaries, with a factor for the allocator's rounding)."""
    return num_tokens * 4 * (2 * intermediate_size + 4 * hidden_size) * 4


def graph_reserve(max_batch: int, hidden_size: int, intermediate_size: int, vocab_size: int) -> int:
    """The decode graphs' pool (the largest batch's activations and logits) and static logits."""
    if max_batch == 0:
        return 0
    return activation_reserve(max_batch, hidden_size, intermediate_size) + 2 * max_batch * vocab_size * 4
