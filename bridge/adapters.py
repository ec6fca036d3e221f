"""Which LoRA adapters a bridged vLLM has loaded, and where: the ``adapters`` of its load report
(kvmesh.contract.types.AdapterResidency; docs/adapters.md).

vLLM 0.32 publishes one series about adapters, ``vllm:lora_requests_info`` (vllm/v1/metrics/loggers.py):
a gauge set to the time of each stats log, labelled ``max_lora`` (its GPU slots), ``running_lora_adapters``
and ``waiting_lora_adapters``, comma-joined adapter names. Despite the names, both labels list every adapter
with a request in flight, running or waiting (vllm/v1/metrics/stats.py, ``update_scheduler_stats`` writes
each adapter of its request map into both, with its counts as values the labels drop). It names only
adapters with a request in flight, so an idle adapter, or one loaded at start-up, looks absent
(llm-d-router#2605). Each label set stays in the registry, so the current one is the sample with the
newest time.

Two sources, the better one used and named (:attr:`AdapterTracker.source`):

- ``gauges``: residency series as vllm-project/vllm PR #54830 proposes them (open, not in 0.32):
  ``vllm:lora_adapter_loaded{adapter_name, level="gpu"|"cpu", pinned, rank}``, 1 while loaded (its other
  series, ``vllm:num_gpu_loaded_lora_adapters`` and ``vllm:max_gpu_lora_adapters``, say nothing more). Read
  as they are.
- ``inferred``: every adapter the server lists at ``/v1/models`` (an entry with a ``parent``) is loaded:
  vLLM keeps a loaded adapter in CPU memory (``--max-cpu-loras``) and copies it into one of ``max_lora``
  GPU slots when a request of it is scheduled, evicting the least recently used slot. So an adapter with
  a request in flight is taken to be in a slot (it is, or its request waits for one); the slots left go to
  the adapters most recently seen in flight (a slot is only evicted for another adapter); the rest, and
  adapters never seen in a request (loaded at start-up or by ``/v1/load_lora_adapter``), are in CPU
  memory. ``requests`` is 1 for an adapter named in the labels (they carry no count), else 0.

This module imports neither zmq nor grpc.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvmesh.contract.types import AdapterLevel, AdapterResidency

LORA_INFO = "vllm:lora_requests_info"
LOADED = "vllm:lora_adapter_loaded"
"""PR #54830's proposed residency gauge (one series per loaded adapter and level)."""
NAMES = frozenset({LORA_INFO, LOADED})
_LEVELS = {"gpu": AdapterLevel.GPU, "cpu": AdapterLevel.CPU}


@dataclass(slots=True, frozen=True)
class LoraInfo:
    """What one scrape of vLLM's /metrics says of adapters (None: LoRA is off)."""

    max_loras: int
    """The GPU slots (0: not said yet: the series has no sample before vLLM's first request)."""
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    loaded: tuple[tuple[str, AdapterLevel], ...] | None = None
    """The residency gauges' word, when the server has them; None = it has not."""


def _names(label: str | None) -> tuple[str, ...]:
    return tuple(n for n in (label or "").split(",") if n)


def parse_lora_info(text: str) -> LoraInfo | None:
    """The adapters' series in a /metrics page (the lines of ``NAMES`` and their ``# TYPE`` lines are enough);
    None when LoRA is off (the series is not registered). Raises ValueError on text that is not Prometheus
    exposition format."""
    newest: tuple[float, dict[str, str]] | None = None
    loaded: list[tuple[str, AdapterLevel]] | None = None
    registered = False
    for family in text_string_to_metric_families(text):
        registered = registered or family.name == LORA_INFO
        for s in family.samples:
            if s.name == LORA_INFO:
                if newest is None or s.value > newest[0]:
                    newest = (s.value, dict(s.labels))
            elif s.name == LOADED and s.value > 0:
                level = _LEVELS.get(s.labels.get("level", "").lower())
                name = s.labels.get("adapter_name", "")
                if level is not None and name:
                    loaded = (loaded or []) + [(name, level)]
    if newest is None:
        # NOTE: the series is registered with --enable-lora but has no sample before the first stats log with
        # a request: LoRA is on, its slots not said yet (0)
        return LoraInfo(0, (), (), None if loaded is None else tuple(loaded)) if registered else None
    labels = newest[1]
    try:
        max_loras = int(labels.get("max_lora", "0"))
    except ValueError:
        max_loras = 0
    return LoraInfo(max_loras, _names(labels.get("running_lora_adapters")), _names(labels.get("waiting_lora_adapters")),
                    None if loaded is None else tuple(loaded))


def listed_adapters(models: Mapping) -> list[str]:
    """The adapters a ``/v1/models`` answer lists: the entries with a parent (vLLM lists the base model
    first, with ``parent`` null, and each LoRA module with its base as parent)."""
    return [m["id"] for m in models.get("data", ()) if isinstance(m, Mapping) and m.get("parent") and m.get("id")]


class AdapterTracker:
    """The residency the bridge reports, from successive scrapes (one per bridge, its scrape thread)."""

    def __init__(self) -> None:
        self.source = ""
        """"gauges" or "inferred" (module docstring); "" until LoRA is seen on."""
        self._recent: dict[str, int] = {}
        """Adapter -> the scrape it was last seen running or waiting (its slot's LRU age)."""
        self._scrapes = 0

    def update(self, info: LoraInfo | None, listed: Iterable[str]) -> tuple[tuple[AdapterResidency, ...], int]:
        """(the adapters, the GPU slots) to report after a scrape; ``listed``: the adapters /v1/models
        lists (read when ``info`` is not None and carries no gauges)."""
        if info is None:
            return (), 0
        self._scrapes += 1
        active = set(info.running) | set(info.waiting)
        for name in active:
            self._recent[name] = self._scrapes
        if info.loaded is not None:
            self.source = "gauges"
            out = {name: AdapterResidency(name, level, 1 if name in active else 0) for name, level in info.loaded}
            return tuple(out[n] for n in sorted(out)), info.max_loras
        self.source = "inferred"
        known = set(listed) | active
        for name in list(self._recent):
            if name not in known:
                del self._recent[name]  # unloaded
        # NOTE: adapters in flight hold slots; the slots left keep the most recently active others (LRU)
        in_slots = set(info.running)
        by_age = sorted((n for n in self._recent if n not in in_slots), key=lambda n: -self._recent[n])
        in_slots.update(by_age[:max(0, info.max_loras - len(in_slots))])
        return tuple(AdapterResidency(n, AdapterLevel.GPU if n in in_slots else AdapterLevel.CPU,
                                      1 if n in active else 0) for n in sorted(known)), info.max_loras
