"""The `gateway` overlay: an InferencePool of the vLLM pods with `kvmesh epp` as its endpoint picker,
validated offline like the other overlays (every Kubernetes object strictly against its schema, the
InferencePool against the Inference Extension's v1 schema below) and the parts wired together."""

from __future__ import annotations

import copy

import jsonschema
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

# The InferencePool of inference.networking.k8s.io/v1 (the Gateway API Inference Extension's CRD
# `inferencepools.inference.networking.k8s.io`, its openAPIV3Schema: required fields, ranges and enums of
# the fields a pool has), closed to unknown fields as the API server's structural pruning would drop them.
_NAME = {"type": "string", "minLength": 1, "maxLength": 253}
_PORT = {"type": "object", "additionalProperties": False, "required": ["number"],
         "properties": {"number": {"type": "integer", "minimum": 1, "maximum": 65535}}}
INFERENCE_POOL_V1 = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "inference.networking.k8s.io/v1"},
        "kind": {"const": "InferencePool"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object", "additionalProperties": False,
            "required": ["selector", "targetPorts", "endpointPickerRef"],
            "properties": {
                "selector": {"type": "object", "additionalProperties": False, "required": ["matchLabels"],
                             "properties": {"matchLabels": {
                                 "type": "object", "minProperties": 1,
                                 "additionalProperties": {"type": "string", "maxLength": 63,
                                                          "pattern": r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"}}}},
                "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1, "items": _PORT},
                "endpointPickerRef": {
                    "type": "object", "additionalProperties": False, "required": ["name"],
                    "properties": {
                        "group": {"type": "string", "maxLength": 253},
                        "kind": {"type": "string", "minLength": 1, "maxLength": 63},
                        "name": _NAME,
                        "port": _PORT,
                        "failureMode": {"enum": ["FailOpen", "FailClose"]},
                    }},
            }},
    },
}


@pytest.fixture(scope="module")
def stack() -> Stack:
    return Stack("gateway", render(K8S / "overlays" / "gateway"))


def epp_args(stack: Stack):
    workload = stack.get("Deployment", "kvmesh-epp")
    (container,) = workload["spec"]["template"]["spec"]["containers"]
    argv = stack.expanded_args(workload, container)
    assert argv[0] == "epp"
    return build_parser(only="epp").parse_args(argv)


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_strictly(stack: Stack, version: str) -> None:
    for obj in stack.objects:
        if obj["kind"] == "InferencePool":
            jsonschema.validate(obj, INFERENCE_POOL_V1)
        else:
            kubernetes_validate.validate(obj, version, strict=True)


def test_the_pool_schema_rejects_what_the_api_server_would(stack: Stack) -> None:
    pool = stack.get("InferencePool", "kvmesh")
    for path, value in ((("spec", "targetPorts"), [{"number": 8000}, {"number": 8001}]),
                        (("spec", "endpointPickerRef", "failureMode"), "Sometimes"),
                        (("spec", "endpointPickerRef", "portNumber"), 9002)):
        bad = copy.deepcopy(pool)
        node = bad
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, INFERENCE_POOL_V1)


def test_the_pool_is_the_vllm_pods_and_its_picker_is_kvmesh_epp(stack: Stack) -> None:
    names = {(o["kind"], o["metadata"]["name"]) for o in stack.objects}
    assert not {n for n in names if n[1] == "kvmesh-router"}  # the gateway is the front door
    pool = stack.get("InferencePool", "kvmesh")["spec"]
    vllm = stack.get("StatefulSet", "kvmesh-vllm")
    assert selects(pool["selector"]["matchLabels"], pod_labels(vllm))
    assert not any(selects(pool["selector"]["matchLabels"], pod_labels(w)) for w in stack.workloads() if w is not vllm)
    vllm_container = next(c for c in vllm["spec"]["template"]["spec"]["containers"] if c["name"] == "vllm")
    assert pool["targetPorts"] == [{"number": container_ports(vllm_container)["http"]}]
    ref = pool["endpointPickerRef"]
    assert ref["kind"] == "Service" and ref["failureMode"] == "FailClose"
    service = stack.get("Service", ref["name"])
    (port,) = service["spec"]["ports"]
    assert port["port"] == ref["port"]["number"]
    epp = stack.get("Deployment", "kvmesh-epp")
    assert selects(service["spec"]["selector"], pod_labels(epp))
    (container,) = epp["spec"]["template"]["spec"]["containers"]
    assert container_ports(container)[port["targetPort"]] == epp_args(stack).port


def test_the_picker_reads_the_index_and_answers_health_as_the_protocol_asks(stack: Stack) -> None:
    args = epp_args(stack)
    kv = stack.get("Service", "kvmesh-kv-service")
    assert args.kv_service == f"kvmesh-kv-service:{kv['spec']['ports'][0]['port']}"
    # it hashes as the bridges do: the same model id, the model's tokenizer
    bridge = next(c for c in stack.get("StatefulSet", "kvmesh-vllm")["spec"]["template"]["spec"]["containers"]
                  if c["name"] == "bridge")
    bridge_argv = stack.expanded_args(stack.get("StatefulSet", "kvmesh-vllm"), bridge)
    bridge_args = build_parser(only="bridge").parse_args(bridge_argv)
    assert args.model_id == bridge_args.model_id and args.model_dirs
    # the bridge registers http://POD_IP:8000: the pick (ip:port of that URL) is a pool member's target port
    from kvmesh.router.api.gateway import endpoint_of

    pool = stack.get("InferencePool", "kvmesh")["spec"]
    assert endpoint_of(bridge_args.advertise_url, args.target_port) == f"{POD_IP}:{pool['targetPorts'][0]['number']}"
    (container,) = stack.get("Deployment", "kvmesh-epp")["spec"]["template"]["spec"]["containers"]
    assert container["readinessProbe"]["grpc"] == {"port": args.port, "service": "readiness"}
    assert container["livenessProbe"]["grpc"] == {"port": args.port, "service": "liveness"}


def test_network_policies_admit_the_gateway_and_the_picker(stack: Stack) -> None:
    kv = stack.get("NetworkPolicy", "kvmesh-kv-service")["spec"]["ingress"][0]["from"]
    assert "epp" in {p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in kv}
    vllm_rules = stack.get("NetworkPolicy", "kvmesh-vllm")["spec"]["ingress"]
    assert any(r.get("from") == [{"namespaceSelector": {}}] and [p["port"] for p in r["ports"]] == [8000]
               for r in vllm_rules)
    epp_rules = stack.get("NetworkPolicy", "kvmesh-epp")["spec"]["ingress"]
    assert {p["port"] for r in epp_rules for p in r["ports"]} == {9002, 9090}
