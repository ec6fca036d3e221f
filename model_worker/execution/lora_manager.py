"""Which LoRA adapters a worker knows, which sit in host memory and which in the device's slots.

vLLM's meanings (``--enable-lora``): ``--max-loras`` device slots; ``--max-cpu-loras`` adapters kept
loaded in host memory (LRU, the rest re-read from disk when needed); an adapter is put in a slot when a
step needs it, evicting the least recently used slot that step does not use. The scheduler admits no
more distinct adapters than slots (scheduler.py), so every step's adapters get one. Adapters are
registered at start-up (``--lora-modules``) or at run time (``load_adapter`` / ``unload_adapter``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable

from kvmesh.model_worker.config import EngineConfig, ModelConfig, parse_lora_modules
from kvmesh.model_worker.execution.models.lora import LoRAAdapter, LoRALayers, load_peft_adapter

log = logging.getLogger(__name__)


class LoRAManager:
    """The registry, the host cache and the device slots of one runner's adapters.

    ``load_adapter`` / ``unload_adapter`` / ``names`` may be called from any thread; ``slots_for``
    runs on the step thread, between steps.

    Args:
        layers: the model's LoRA projections (their slots are written here only).
        model_config: the base model's (adapters are checked against it).
        max_cpu_loras: adapters kept in host memory.
    """

    def __init__(self, layers: LoRALayers, model_config: ModelConfig, max_cpu_loras: int) -> None:
        self.layers = layers
        self.model_config = model_config
        self.max_loras = layers.max_loras
        self.max_rank = layers.max_rank
        self.max_cpu_loras = max_cpu_loras
        self._lock = threading.Lock()
        self._paths: dict[str, str] = {}
        self._cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()
        """Host-resident adapters, least recently used first."""
        self._slots: OrderedDict[str, int] = OrderedDict()
        """Adapters in device slots, least recently used first."""
        self._free = list(range(self.max_loras))
        self.num_slot_loads = 0
        """Adapters written into a slot so far (a slot miss)."""
        self.num_disk_loads = 0
        """Adapters read from disk so far (registration included)."""
        self.cpu_loads = 0
        self.cpu_load_s = 0.0
        self.disk_loads = 0
        self.disk_load_s = 0.0
        """Slot loads by source (host memory, disk) and the seconds they took on the step thread (the load
        report's counters; on CUDA the copy is enqueued, so a copy's seconds are its launch's)."""

    @classmethod
    def for_engine(cls, model, model_config: ModelConfig, cfg: EngineConfig) -> LoRAManager | None:
        """The manager of ``model``'s adapters under the engine's flags, ``--lora-modules`` registered; None
        without ``--enable-lora``. Wraps the model's projections in their slots."""
        if not cfg.enable_lora:
            return None
        assert cfg.max_cpu_loras is not None
        manager = cls(LoRALayers(model, model_config, cfg.max_loras, cfg.max_lora_rank), model_config,
                      cfg.max_cpu_loras)
        for name, path in parse_lora_modules(cfg.lora_modules):
            manager.load_adapter(name, path)
        return manager

    @property
    def names(self) -> list[str]:
        with self._lock:
            return list(self._paths)

    def has(self, name: str) -> bool:
        return name in self._paths

    def residency(self) -> dict[str, list[str]]:
        """``{"gpu": [...], "cpu": [...]}``: the adapters in device slots and in host memory (idle ones too)."""
        with self._lock:
            return {"gpu": list(self._slots), "cpu": list(self._cpu)}

    def load_adapter(self, name: str, path: str) -> None:
        """Registers adapter ``name`` from the PEFT directory ``path``, read and checked now.

        Raises:
            ValueError: a bad name, a name in use, or an adapter this model cannot serve (what is wrong).
        """
        if not name or name != name.strip():
            raise ValueError(f"a LoRA adapter name must be non-empty without surrounding spaces, got {name!r}")
        if name in self._paths:
            raise ValueError(f"LoRA adapter {name!r} is already loaded (from {self._paths[name]}); unload it first")
        adapter = load_peft_adapter(name, path, self.model_config, self.max_rank)
        with self._lock:
            if name in self._paths:
                raise ValueError(f"LoRA adapter {name!r} is already loaded")
            self._paths[name] = str(path)
            self.num_disk_loads += 1
            self._cache(adapter)
        log.info("loaded LoRA adapter %s (rank %d, scale %g) from %s", name, adapter.rank, adapter.scale, path)

    def unload_adapter(self, name: str) -> None:
        """Forgets adapter ``name`` (host copy and slot). The caller makes sure no live request uses it.

        Raises:
            ValueError: no adapter of that name is loaded.
        """
        with self._lock:
            if name not in self._paths:
                raise ValueError(f"no LoRA adapter {name!r} is loaded")
            del self._paths[name]
            self._cpu.pop(name, None)
            slot = self._slots.pop(name, None)
            if slot is not None:
                self._free.append(slot)

    def slots_for(self, names: Iterable[str]) -> dict[str, int]:
        """The slot of each adapter a step uses, writing the missing ones in (step thread).

        Raises:
            ValueError: more adapters than slots (the scheduler never asks that), or an unknown one.
        """
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step uses {len(wanted)} LoRA adapters; --max-loras is {self.max_loras}")
        with self._lock:
            out: dict[str, int] = {}
            for name in wanted:
                slot = self._slots.get(name)
                if slot is not None:
                    self._slots.move_to_end(name)
                    out[name] = slot
            for name in wanted:
                if name in out:
                    continue
                t0 = time.perf_counter()
                from_disk = name not in self._cpu
                adapter = self._host_copy(name)
                if self._free:
                    slot = self._free.pop(0)
                else:
                    # NOTE: the least recently used slot this step does not use (there is one: wanted <= slots).
                    victim = next(n for n in self._slots if n not in out and n not in wanted)
                    slot = self._slots.pop(victim)
                self.layers.write(slot, adapter)
                self.num_slot_loads += 1
                took = time.perf_counter() - t0
                if from_disk:
                    self.disk_loads += 1
                    self.disk_load_s += took
                else:
                    self.cpu_loads += 1
                    self.cpu_load_s += took
                self._slots[name] = slot
                out[name] = slot
            return out

    def _host_copy(self, name: str) -> LoRAAdapter:
        adapter = self._cpu.get(name)
        if adapter is not None:
            self._cpu.move_to_end(name)
            return adapter
        path = self._paths.get(name)
        if path is None:
            raise ValueError(f"no LoRA adapter {name!r} is loaded")
        adapter = load_peft_adapter(name, path, self.model_config, self.max_rank)
        self.num_disk_loads += 1
        self._cache(adapter)
        return adapter

    def _cache(self, adapter: LoRAAdapter) -> None:
        self._cpu[adapter.name] = adapter
        self._cpu.move_to_end(adapter.name)
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)
