"""How many threads torch computes with on a CPU worker: every usable core but one, unless someone chose
(docs/engine.md, "CPU performance")."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_TORCH_DEFAULT_THREADS = torch.get_num_threads()
"""torch's own choice, read when this module is first imported (before anyone sets it)."""
_CHOSEN_THREADS = False
"""Whether :func:`set_cpu_threads` chose the count (then the engine keeps it)."""


def set_cpu_threads(threads: int) -> None:
    """Sets torch's intra-op threads and keeps the engine from changing them, whatever the count.

    NOTE: ``torch.set_num_threads`` alone is not enough: a choice equal to torch's default (2 on a
    2-core machine) looks like no choice to :func:`apply_cpu_threads`, which then sets 1.
    """
    global _CHOSEN_THREADS
    torch.set_num_threads(threads)
    _CHOSEN_THREADS = True


def default_cpu_threads(usable_cores: int) -> int:
    """The engine's intra-op threads on CPU: every usable core but one, at least one.

    As vLLM's CPU worker does (one core left to its scheduler and front end): the engine shares
    its process with the scheduler, the gRPC server and the stream threads, and a machine's cores
    are often shared with other processes. On this project's 2-core machine one thread ran the
    peer benchmark's workloads ~2x faster than two (docs/engine.md, CPU performance).
    """
    return max(1, usable_cores - 1)


def usable_cores(cpu_max: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The cores this process may use: its CPU affinity, capped by its cgroup v2 CPU quota.

    NOTE: a Kubernetes pod with ``limits.cpu: 2`` on a 64-core node sees all 64 in its affinity;
    only the quota (``cpu.max``: "200000 100000") says 2, and 63 threads on a 2-CPU quota are
    throttled most of each period.
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path(cpu_max).read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 quota here (or unreadable): the affinity is all we know
    return cores


def apply_cpu_threads() -> None:
    """Sets torch's intra-op threads to ``default_cpu_threads`` unless someone chose: the
    ``OMP_NUM_THREADS`` environment variable, or ``torch.set_num_threads`` before the engine starts
    (``kvmesh worker --torch-threads`` and the benchmarks' ``--threads`` call :func:`set_cpu_threads`)."""
    if _CHOSEN_THREADS or "OMP_NUM_THREADS" in os.environ or torch.get_num_threads() != _TORCH_DEFAULT_THREADS:
        return
    threads = default_cpu_threads(usable_cores())
    if threads != torch.get_num_threads():
        log.info("torch CPU threads %d -> %d (one core left for the scheduler and server; set "
                 "OMP_NUM_THREADS or --torch-threads to choose)", torch.get_num_threads(), threads)
        torch.set_num_threads(threads)
