"""A worker's load as its engine reports it (heartbeats, routing): the type of ``LLMEngine.stats()``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from kvmesh.contract.types import AdapterLevel, AdapterResidency, Load
from kvmesh.model_worker.scheduling.output import StepWork


@dataclass(slots=True)
class EngineStats:
    """A worker's load as it reports it (heartbeats, routing)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    queued_prefill_tokens: int
    prefix_cache_queries: int
    """Prompt tokens looked up in the prefix cache so far."""
    prefix_cache_hits: int
    """Of those, tokens found cached (on the device or in the host tier)."""
    host_cache_hits: int = 0
    """Of those, tokens found in the host tier and loaded back."""
    num_host_blocks: int = 0
    """Blocks of the host KV tier (0: none)."""
    num_host_cached_blocks: int = 0
    """Of those, blocks holding a hash."""
    busy_s: float = 0.0
    """Seconds spent in steps since start (modelled seconds on a simulated worker)."""
    steps: int = 0
    """Forward passes since start (every inner step of a multi-step window counts)."""
    work: StepWork = field(default_factory=StepWork)
    """Work of those passes since start: what ``busy_s`` was spent on."""
    max_num_batched_tokens: int = 0
    host_loaded_blocks: int = 0
    """Blocks loaded back from the host tier since start."""
    host_load_s: float = 0.0
    """Seconds those loads took (part of ``busy_s``; modelled seconds on a simulated worker)."""
    num_cached_blocks: int = 0
    """Device blocks holding a cached prefix (in use or idle)."""
    adapter_requests: dict[str, int] = field(default_factory=dict)
    """Per LoRA adapter, its requests running or waiting (--enable-lora)."""
    adapters: tuple[AdapterResidency, ...] = ()
    """The LoRA adapters the worker serves and where each is (docs/adapters.md)."""
    max_loras: int = 0
    """GPU adapter slots (0: no LoRA)."""
    adapter_loads: tuple[int, float, int, float] = (0, 0.0, 0, 0.0)
    """Slot loads from CPU memory (count, seconds) and from disk (count, seconds), cumulative."""
    prefilling_tokens: int = 0
    """Uncached prompt tokens of the scheduler's requests without a token yet, whole (Scheduler.prefilling_tokens);
    the inbox's requests are not in it (stats() adds them to the queued prefill only)."""

    @property
    def load(self) -> Load:
        return self.report()

    def report(self, admitted: tuple[str, ...] = (), reports_admissions: bool = False) -> Load:
        """The load, with the admissions it covers (what a kvmesh worker reports)."""
        w = self.work
        return Load(self.num_running, self.num_waiting, self.num_free_blocks, self.num_total_blocks,
                    self.queued_prefill_tokens, self.busy_s, self.steps, w.prefill_tokens, w.prefill_pairs,
                    w.decode_seqs, w.decode_context_tokens, self.max_num_batched_tokens, admitted,
                    reports_admissions, host_loaded_blocks=self.host_loaded_blocks, host_load_s=self.host_load_s,
                    num_cached_blocks=self.num_cached_blocks, adapters=self.adapters, max_loras=self.max_loras,
                    adapter_cpu_loads=self.adapter_loads[0], adapter_cpu_load_s=self.adapter_loads[1],
                    adapter_disk_loads=self.adapter_loads[2], adapter_disk_load_s=self.adapter_loads[3],
                    prefilling_tokens=self.prefilling_tokens)


class AdapterSlots(Protocol):
    """What the load report reads of a worker's LoRA adapters (execution/lora_manager.py, simulated/sim_lora.py)."""

    @property
    def names(self) -> list[str]: ...

    def residency(self) -> dict[str, list[str]]: ...


def adapter_requests(requests: Iterable) -> dict[str, int]:
    """Per LoRA adapter, its requests among ``requests`` (the scheduler's, on the step thread)."""
    counts: dict[str, int] = {}
    for r in requests:
        if r.lora_name:
            counts[r.lora_name] = counts.get(r.lora_name, 0) + 1
    return counts


def adapter_residency(lora: AdapterSlots, requests: dict[str, int]) -> tuple[AdapterResidency, ...]:
    """Every adapter the worker serves and where it is now: a GPU slot, host memory, else disk (the manager's
    registry and caches are read under its lock: an adapter loaded on an idle engine shows)."""
    where = lora.residency()
    gpu, cpu = set(where["gpu"]), set(where["cpu"])
    return tuple(AdapterResidency(n, AdapterLevel.GPU if n in gpu else AdapterLevel.CPU if n in cpu
                                  else AdapterLevel.DISK, requests.get(n, 0)) for n in sorted(lora.names))
