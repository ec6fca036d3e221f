"""The field's LoRA-aware scorers, each added to llm-d's precise-prefix profile (field.py ``llm-d``) with weight 1,
as an llm-d scheduler configuration adds a scorer to a profile: ``llm-d-lora-affinity`` (llm-d's lora-affinity-scorer)
and ``llm-d-lora-load-state`` (llm-d-router PR #2792's lora-load-state-scorer). Written for kvmesh's candidates; no
code of those projects is copied. docs/adapters.md lists how each differs from its source and which way it biases.

This module imports neither grpc nor redis.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvmesh.contract.types import AdapterLevel, Load
from kvmesh.router.core.policies.base import Candidate, RouteQuery
from kvmesh.router.core.policies.field import LlmdPolicy


def in_flight(load: Load) -> set[str]:
    """The adapters with a request running or waiting: all that vLLM 0.32's ``vllm:lora_requests_info`` names
    (its ``running_lora_adapters`` and ``waiting_lora_adapters`` both list each of them)."""
    return {a.name for a in load.adapters if a.requests > 0}


def lora_affinity_score(adapter: str, load: Load) -> float:
    """llm-d's lora-affinity-scorer (llm-d/llm-d-router @683100dc9f29,
    ``pkg/epp/framework/plugins/scheduling/scorer/loraaffinity/lora_affinity.go``, ``Score``): 1.0 when the adapter
    is in ActiveModels; else 0.8 when ``len(ActiveModels) + len(WaitingModels) < MaxActiveModels``; else 0.6 when
    it is in WaitingModels; else 0. Both maps are read from ``vllm:lora_requests_info`` (both the in-flight set),
    MaxActiveModels from its ``max_lora`` (the worker's slots). Its blind spot: an idle adapter in a slot is absent.
    A base-model request (no adapter) is scored as an adapter in no map (the scorer looks up the target model)."""
    active = waiting = in_flight(load)
    if adapter in active:
        return 1.0
    # NOTE: the sum of the two maps' sizes, as the source has it (not their union): vLLM lists each adapter in
    # flight in both, so the slots look full at half their number.
    if len(active) + len(waiting) < load.max_loras:
        return 0.8
    if adapter in waiting:
        return 0.6
    return 0.0


def lora_load_state_score(adapter: str, load: Load) -> float:
    """llm-d-router PR #2792's lora-load-state-scorer (open, not merged; its tiers as issue 52 gives them), read
    from the residency vLLM PR #54830 proposes (kvmesh's ``Load.adapters``): in a GPU slot 1.0; in CPU memory 0.7;
    a free GPU slot 0.6; a slot whose adapter has no request (evictable) 0.3; every slot serving requests 0. A
    base-model request: the share of slots not serving an adapter's requests now."""
    slots = load.max_loras
    busy = in_flight(load)
    if not adapter:
        return (slots - min(slots, len(busy))) / slots if slots else 1.0
    mine = load.adapter(adapter)
    if mine is not None and mine.level == AdapterLevel.GPU:
        return 1.0
    if mine is not None and mine.level == AdapterLevel.CPU:
        return 0.7
    resident = [a for a in load.adapters if a.level == AdapterLevel.GPU]
    if len(resident) < slots:
        return 0.6
    if any(a.requests == 0 for a in resident):
        return 0.3
    return 0.0


class LlmdLoraAffinityPolicy(LlmdPolicy):
    """llm-d's precise-prefix profile (prefix 2, queue 1, kv-cache utilisation 1) plus its lora-affinity-scorer
    with weight 1 (:func:`lora_affinity_score`), read from the same 50 ms scrapes."""

    name = "llm-d-lora-affinity"
    lora_weight = 1.0

    @staticmethod
    def lora_score(adapter: str, load: Load) -> float:
        return lora_affinity_score(adapter, load)

    def scores(self, query: RouteQuery, candidates: Sequence[Candidate], loads: Sequence[Load]) -> list[float]:
        base = super().scores(query, candidates, loads)
        return [s + self.lora_weight * self.lora_score(query.adapter, load) for s, load in zip(base, loads, strict=True)]


class LlmdLoraLoadStatePolicy(LlmdLoraAffinityPolicy):
    """llm-d's precise-prefix profile plus PR #2792's lora-load-state-scorer with weight 1
    (:func:`lora_load_state_score`) in the affinity scorer's place."""

    name = "llm-d-lora-load-state"

    @staticmethod
    def lora_score(adapter: str, load: Load) -> float:
        return lora_load_state_score(adapter, load)
