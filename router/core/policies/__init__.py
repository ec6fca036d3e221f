"""The routing policies (docs/router.md) and their registry: ``--policy NAME``.

- kvmesh's own: ``kv-aware`` (kv_aware.py);
- the plain ones: ``round-robin``, ``least-loaded``, and SGLang's ``prefix-hash`` (basic.py);
- the field's, each from its own source: ``approx-tree`` (SGLang's cache-aware router,
  approx_tree.py), ``dynamo`` (dynamo.py), ``preble`` (preble.py), ``llm-d`` and ``lmetric`` (field.py),
  llm-d's sticky-until-saturated ``llm-d-sticky`` and ``llm-d-sticky-decode`` (llmd_sticky.py), llm-d's
  predicted-latency scheduler ``llm-d-predicted`` (llmd_predicted.py); llm-d with a LoRA scorer,
  ``llm-d-lora-affinity`` and ``llm-d-lora-load-state`` (lora.py);
- kv-aware blind to LoRA residency, ``kv-aware-no-residency`` (kv_aware.py; docs/adapters.md).

A policy is pure: no grpc, no I/O, no clock but the injected one (router/core/policies/base.py).
"""

from __future__ import annotations

from kvmesh.router.core.policies.approx_tree import ApproxTreePolicy
from kvmesh.router.core.policies.base import PolicyConfig, RouterPolicy
from kvmesh.router.core.policies.basic import LeastLoadedPolicy, PrefixHashPolicy, RoundRobinPolicy
from kvmesh.router.core.policies.dynamo import DynamoPolicy
from kvmesh.router.core.policies.field import LlmdPolicy, LmetricPolicy
from kvmesh.router.core.policies.kv_aware import KvAwareNoResidencyPolicy, KvAwarePolicy
from kvmesh.router.core.policies.llmd_predicted import LlmdPredictedPolicy
from kvmesh.router.core.policies.llmd_sticky import LlmdStickyDecodePolicy, LlmdStickyPolicy
from kvmesh.router.core.policies.lora import LlmdLoraAffinityPolicy, LlmdLoraLoadStatePolicy
from kvmesh.router.core.policies.preble import PreblePolicy

POLICIES: dict[str, type[RouterPolicy]] = {
    p.name: p for p in (KvAwarePolicy, RoundRobinPolicy, LeastLoadedPolicy, PrefixHashPolicy, ApproxTreePolicy,
                        DynamoPolicy, LlmdPolicy, PreblePolicy, LmetricPolicy, LlmdStickyPolicy, LlmdStickyDecodePolicy,
                        LlmdPredictedPolicy, LlmdLoraAffinityPolicy, LlmdLoraLoadStatePolicy, KvAwareNoResidencyPolicy)
}


POLICY_ORDER = ("kv-aware", "round-robin", "least-loaded", "prefix-hash", "approx-tree", "dynamo", "llm-d", "preble",
                "lmetric", "llm-d-sticky", "llm-d-sticky-decode", "llm-d-predicted", "llm-d-lora-affinity",
                "llm-d-lora-load-state", "kv-aware-no-residency")
"""The order policies are listed and run in (tables, JSON)."""

ADAPTER_PEERS = {"llm-d-lora-affinity": "llm-d", "llm-d-lora-load-state": "llm-d", "kv-aware-no-residency": "kv-aware"}
"""Policies that differ from another only where requests run under LoRA adapters, and that other: without an
adapter in flight, llm-d's two LoRA scorers add a score equal on every worker to llm-d's (lora.py), and
kv-aware-no-residency drops only kv-aware's adapter terms. ``kvmesh simulate`` leaves them out of its default
policies on a workload without adapters (tests/sim/test_adapter_peers_base.py checks that they pick the same)."""


def policy_names() -> list[str]:
    """Every registered policy name: ``POLICY_ORDER`` first, any other after it, alphabetically."""
    rank = {name: i for i, name in enumerate(POLICY_ORDER)}
    return sorted(POLICIES, key=lambda n: (rank.get(n, len(rank)), n))


def make_policy(name: str, config: PolicyConfig | None = None) -> RouterPolicy:
    """The policy registered under ``name`` (``--policy``).

    Raises:
        ValueError: no policy has that name.
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(policy_names())}") from None
    return cls(config)
