"""The `vllm` overlay: vLLM pods with `kvmesh bridge` as a sidecar, validated offline like the other
overlays (strict schemas, the parts wired together, the KV event ports kept inside the pod)."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest

from kvmesh.cli import build_parser
from tests.support.k8s import (
    K8S,
    K8S_VERSIONS,
    POD_IP,
    Stack,
    container_ports,
    pod_labels,
    render,
    selects,
)


@pytest.fixture(scope="module")
def stack() -> Stack:
    return Stack("vllm", render(K8S / "overlays" / "vllm"))


def containers(stack: Stack) -> dict[str, dict]:
    pod = stack.get("StatefulSet", "kvmesh-vllm")["spec"]["template"]["spec"]
    return {c["name"]: c for c in pod["containers"]}


def bridge_args(stack: Stack):
    workload = stack.get("StatefulSet", "kvmesh-vllm")
    argv = stack.expanded_args(workload, containers(stack)["bridge"])
    assert argv[0] == "bridge" and containers(stack)["bridge"].get("command") is None
    return build_parser(only="bridge").parse_args(argv)


def vllm_flags(stack: Stack) -> dict[str, str]:
    workload = stack.get("StatefulSet", "kvmesh-vllm")
    argv = stack.expanded_args(workload, containers(stack)["vllm"])
    flags = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    flags["model"] = argv[0]
    flags.update({a[2:]: "" for a in argv if a.startswith("--") and "=" not in a})
    return flags


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_strictly(stack: Stack, version: str) -> None:
    for obj in stack.objects:
        kubernetes_validate.validate(obj, version, strict=True)


def test_vllm_pods_replace_kvmesh_workers(stack: Stack) -> None:
    names = {(o["kind"], o["metadata"]["name"]) for o in stack.objects}
    assert not {n for n in names if n[1] == "kvmesh-worker"}
    assert {("StatefulSet", "kvmesh-vllm"), ("Service", "kvmesh-vllm"), ("PodDisruptionBudget", "kvmesh-vllm"),
            ("NetworkPolicy", "kvmesh-vllm"), ("Deployment", "kvmesh-router")} <= names
    assert sorted(containers(stack)) == ["bridge", "vllm"]


def test_the_bridge_reads_its_own_pods_vllm_and_registers_it_for_routers(stack: Stack) -> None:
    args, vllm = bridge_args(stack), vllm_flags(stack)
    events = json.loads(vllm["kv-events-config"])
    assert events["enable_kv_cache_events"] and events["publisher"] == "zmq"
    port = int(vllm["port"])
    assert args.url == f"http://127.0.0.1:{port}" and args.advertise_url == f"http://{POD_IP}:{port}"
    assert args.events == events["endpoint"].replace("*", "127.0.0.1")
    assert args.replay == events["replay_endpoint"].replace("*", "127.0.0.1")
    assert container_ports(containers(stack)["vllm"]) == {"http": port, "kv-events": 5557, "kv-replay": 5558}
    assert container_ports(containers(stack)["bridge"]) == {"metrics": args.metrics_port}
    kv = stack.get("Service", "kvmesh-kv-service")
    assert args.kv_service == f"kvmesh-kv-service:{kv['spec']['ports'][0]['port']}"
    assert args.worker_id == "kvmesh-vllm-0" and args.engine == "vllm"
    # one model: the router hashes with the same id and block size vLLM's blocks are re-hashed with
    router = stack.cli_args("router")
    assert args.model_id == router.model_id == vllm["served-model-name"]
    assert vllm["model"] == router.model_dirs[0]
    assert int(vllm["block-size"]) % args.block_size == 0 and args.block_size == router.block_size
    assert "enable-prompt-tokens-details" in vllm and "enable-prefix-caching" in vllm


def test_the_kv_event_ports_stay_inside_the_pod(stack: Stack) -> None:
    labels = pod_labels(stack.get("StatefulSet", "kvmesh-vllm"))
    policies = [p for p in stack.all("NetworkPolicy") if selects(p["spec"]["podSelector"]["matchLabels"], labels)]
    assert len(policies) == 1
    rules = policies[0]["spec"]["ingress"]
    opened = {p["port"] for r in rules for p in r["ports"]}
    assert opened == {8000, 9103}
    api = next(r for r in rules if any(p["port"] == 8000 for p in r["ports"]))
    assert [peer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for peer in api["from"]] == ["router"]
    kv = stack.get("NetworkPolicy", "kvmesh-kv-service")["spec"]["ingress"][0]["from"]
    assert {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in kv} == {"router", "worker",
                                                                                           "vllm"}


def test_kvmesh_containers_use_the_cpu_image_and_run_as_non_root(stack: Stack) -> None:
    for workload in stack.workloads():
        spec = workload["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["automountServiceAccountToken"] is False
        for c in spec["containers"] + spec.get("initContainers", []):
            if c["image"].startswith("kvmesh"):
                assert c["image"] == "kvmesh:0.1.0-cpu"
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert "memory" in c["resources"]["limits"]
    assert containers(stack)["vllm"]["resources"]["limits"]["nvidia.com/gpu"] == "1"
