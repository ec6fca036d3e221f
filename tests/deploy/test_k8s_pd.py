"""The `pd` overlay: prefill and decode pools of kvmesh workers (llm-d's `llm-d.ai/role` label), validated
offline like the other overlays: strict schemas, each pool's selectors, Service and PDB its own, the roles parsed
by the real `kvmesh worker` parser, the pools otherwise identical, decode workers allowed to reach prefill workers."""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest

from kvmesh.cli import build_parser
from tests.support.k8s import K8S, K8S_VERSIONS, Stack, pod_labels, render, selects

POOLS = {"prefill": "kvmesh-worker-prefill", "decode": "kvmesh-worker"}


@pytest.fixture(scope="module")
def stack() -> Stack:
    return Stack("pd", render(K8S / "overlays" / "pd"))


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_strictly(stack: Stack, version: str) -> None:
    for obj in stack.objects:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("role", POOLS)
def test_each_pool_runs_its_role_and_selects_only_its_pods(stack: Stack, role: str) -> None:
    sts = stack.get("StatefulSet", POOLS[role])
    labels = pod_labels(sts)
    assert labels["llm-d.ai/role"] == role
    assert selects(sts["spec"]["selector"]["matchLabels"], labels)
    container = sts["spec"]["template"]["spec"]["containers"][0]
    args = build_parser(only="worker").parse_args(stack.expanded_args(sts, container))
    assert args.role == role and args.device == "cuda"
    others = [pod_labels(stack.get("StatefulSet", n)) for r, n in POOLS.items() if r != role]
    for kind, sel in (("Service", lambda o: o["spec"]["selector"]),
                      ("PodDisruptionBudget", lambda o: o["spec"]["selector"]["matchLabels"])):
        obj = stack.get(kind, POOLS[role])
        assert selects(sel(obj), labels), kind
        assert not any(selects(sel(obj), other) for other in others), f"{kind} {POOLS[role]} selects the other pool"
    assert sts["spec"]["serviceName"] == POOLS[role]


def test_the_pools_differ_only_in_name_role_and_size(stack: Stack) -> None:
    pre, dec = (copy.deepcopy(stack.get("StatefulSet", POOLS[r])) for r in ("prefill", "decode"))
    for sts in (pre, dec):
        sts["metadata"].pop("name")
        sts["spec"].pop("serviceName")
        sts["spec"].pop("replicas")
        sts["spec"]["selector"]["matchLabels"].pop("llm-d.ai/role")
        sts["spec"]["template"]["metadata"]["labels"].pop("llm-d.ai/role")
        args = sts["spec"]["template"]["spec"]["containers"][0]["args"]
        args.remove(next(a for a in args if a.startswith("--role=")))
        env = sts["spec"]["template"]["spec"]["containers"][0]["env"]
        env.sort(key=lambda e: e["name"])
    assert pre == dec


def test_decode_workers_may_reach_prefill_workers_for_the_kv(stack: Stack) -> None:
    policy = stack.get("NetworkPolicy", "kvmesh-worker")
    pre = pod_labels(stack.get("StatefulSet", POOLS["prefill"]))
    dec = pod_labels(stack.get("StatefulSet", POOLS["decode"]))
    assert selects(policy["spec"]["podSelector"]["matchLabels"], pre)
    rule = next(r for r in policy["spec"]["ingress"] if any(
        selects(f.get("podSelector", {}).get("matchLabels", {}), dec) for f in r.get("from", [])))
    ports = {(p["port"], p.get("endPort")) for p in rule["ports"]}
    assert (50061, None) in ports
    ucx = next(e["value"] for e in stack.get("StatefulSet", POOLS["prefill"])["spec"]["template"]["spec"]["containers"][0]
               ["env"] if e["name"] == "UCX_TCP_PORT_RANGE")
    lo, hi = (int(x) for x in ucx.split("-"))
    assert (lo, hi) in ports
