"""Simulated LoRA adapters: the GPU slots, the host cache and the time a load takes, no weights.

What the engine reads of a LoRA manager (model_worker/execution/lora_manager.py: ``names``, ``has``,
``residency()``, ``max_loras``) over a model of vLLM's (``--max-loras`` GPU slots, LRU; ``--max-cpu-loras``
adapters kept in host memory, LRU; the rest read from disk again). A step whose requests use an adapter
not in a slot waits for its load before the forward pass (vLLM loads the step's adapters in
``set_active_adapters`` before running the model), so :meth:`SimLoRA.load_s` is added to the step's time:

    from host memory: adapter bytes / pcie_bps                    (a copy over PCIe)
    from disk:        disk_fixed_s + adapter bytes / disk_bps + adapter bytes / pcie_bps

The adapter's bytes are those of rank ``rank`` on every attention and MLP projection of the simulated model
(:func:`lora_bytes`): Llama-3-8B at rank 16 in bf16 is 83.9 MB (3.4 ms over PCIe 4 at ~25 GB/s, 65 ms from an
NVMe disk at ~2 GB/s plus ~20 ms to open and parse the safetensors file; assumptions, not measurements).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from kvmesh.model_worker.simulated.step_time import LLAMA_31_8B, ModelShape

LLAMA_3_8B_INTERMEDIATE = 14_336
"""meta-llama/Meta-Llama-3-8B's config.json ``intermediate_size`` (the other shape figures: step_time.py)."""


def lora_bytes(model: ModelShape = LLAMA_31_8B, intermediate: int = LLAMA_3_8B_INTERMEDIATE, rank: int = 16) -> int:
    """Bytes of one LoRA adapter of ``rank`` on q/k/v/o/gate/up/down of every layer: A (rank x in) and
    B (out x rank) per projection, in the model's dtype."""
    h, kv = model.hidden, model.kv_heads * model.head_dim
    in_out = [(h, h), (h, kv), (h, kv), (h, h), (h, intermediate), (h, intermediate), (intermediate, h)]
    return model.layers * rank * sum(i + o for i, o in in_out) * model.dtype_bytes


@dataclass(frozen=True, slots=True)
class LoadCosts:
    """Seconds to put one adapter in a GPU slot, by where it is."""

    adapter_bytes: int = lora_bytes()
    pcie_bps: float = 25e9
    """Host to device copy (PCIe 4 x16, ~25 GB/s of its 32 GB/s in practice)."""
    disk_bps: float = 2e9
    """Sequential read of the adapter's file (a datacenter NVMe, ~2 GB/s)."""
    disk_fixed_s: float = 0.020
    """Opening and parsing the adapter's files, per load from disk."""

    @property
    def cpu_s(self) -> float:
        return self.adapter_bytes / self.pcie_bps

    @property
    def disk_s(self) -> float:
        return self.disk_fixed_s + self.adapter_bytes / self.disk_bps + self.cpu_s


class SimLoRA:
    """The slots and host cache of a simulated worker's adapters (the LoRAManager interface the engine reads).

    Args:
        names: the adapters the worker serves (all on disk at the start).
        max_loras: GPU slots.
        max_cpu_loras: adapters kept in host memory (LRU; 0 = every load is from disk).
        costs: what a load costs.
    """

    def __init__(self, names: Iterable[str], max_loras: int, max_cpu_loras: int, costs: LoadCosts | None = None) -> None:
        if max_loras < 1 or max_cpu_loras < 0:
            raise ValueError(f"--max-loras must be >= 1 and --max-cpu-loras >= 0, got {max_loras}, {max_cpu_loras}")
        self._names = list(dict.fromkeys(names))
        self._known = set(self._names)
        self.max_loras = max_loras
        self.max_cpu_loras = max_cpu_loras
        self.costs = costs or LoadCosts()
        self._slots: OrderedDict[str, None] = OrderedDict()
        """Adapters in GPU slots, least recently used first."""
        self._cpu: OrderedDict[str, None] = OrderedDict()
        """Adapters in host memory, least recently used first."""
        self.cpu_loads = 0
        self.disk_loads = 0
        self.cpu_load_s = 0.0
        self.disk_load_s = 0.0
        """Modelled seconds of the loads from CPU memory and from disk (the load report's counters)."""
        self.load_s_total = 0.0

    @property
    def names(self) -> list[str]:
        return list(self._names)

    def has(self, name: str) -> bool:
        return name in self._known

    def residency(self) -> dict[str, list[str]]:
        """``{"gpu": [...], "cpu": [...]}`` as LoRAManager's: the slots' adapters, and host memory's."""
        return {"gpu": list(self._slots), "cpu": list(self._cpu)}

    def load_s(self, step: Iterable[str], running: Iterable[str] = ()) -> float:
        """Puts every adapter of a step in a slot; returns the seconds its loads take.

        ``running``: adapters of the engine's running requests besides the step's: their slots are not
        evicted either (the scheduler admits no more distinct adapters than slots, so one is free or idle).

        Raises:
            ValueError: more adapters than slots, or an unknown one.
        """
        wanted = [n for n in dict.fromkeys(step) if n]
        keep = set(wanted).union(running)
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step uses {len(wanted)} LoRA adapters; --max-loras is {self.max_loras}")
        total = 0.0
        for name in wanted:
            if name in self._slots:
                self._slots.move_to_end(name)
                if name in self._cpu:
                    self._cpu.move_to_end(name)
                continue
            if name not in self._known:
                raise ValueError(f"no LoRA adapter {name!r} is loaded")
            if name in self._cpu:
                self._cpu.move_to_end(name)
                total += self.costs.cpu_s
                self.cpu_loads += 1
                self.cpu_load_s += self.costs.cpu_s
            else:
                total += self.costs.disk_s
                self.disk_loads += 1
                self.disk_load_s += self.costs.disk_s
                if self.max_cpu_loras:
                    self._cpu[name] = None
                    while len(self._cpu) > self.max_cpu_loras:
                        self._cpu.popitem(last=False)
            if len(self._slots) >= self.max_loras:
                # NOTE: the least recently used slot whose adapter no running request uses; with more
                # running adapters than slots (never, under the scheduler's cap) the least recently used.
                victim = next((n for n in self._slots if n not in keep), None)
                if victim is None:
                    victim = next(n for n in self._slots if n not in wanted)
                del self._slots[victim]
            self._slots[name] = None
        self.load_s_total += total
        return total
