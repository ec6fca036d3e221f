"""The kustomize overlays: every object valid against the Kubernetes schemas, and the parts wired
together (Service selectors, ports, probes, CLI args, HPA, PDBs, NetworkPolicies)."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from urllib.parse import urlsplit

import kubernetes_validate
import pytest

from kvmesh.cli import build_parser
from tests.support.k8s import (
    COMMANDS,
    COMPONENTS,
    K8S,
    K8S_VERSIONS,
    NAMESPACE,
    OVERLAYS,
    POD_IP,
    Stack,
    container_ports,
    pod_labels,
    probes,
    render,
    selects,
)


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(K8S / "overlays" / name) for name in OVERLAYS}


@pytest.fixture(params=OVERLAYS)
def stack(request, rendered) -> Stack:
    return Stack(request.param, rendered[request.param])


# --- schemas -------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_validates_strictly(stack: Stack, version: str) -> None:
    # strict: an unknown or misspelt field fails, not just a wrong type. No CRDs here (metrics are
    # scraped through prometheus.io annotations, not a ServiceMonitor), so every kind has a schema.
    for obj in stack.objects:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{stack.name}: {obj['kind']}/{obj['metadata']['name']} at {path}: {exc.message}")


def test_strict_validation_rejects_an_unknown_field(stack: Stack) -> None:
    bad = copy.deepcopy(stack.workload("router"))
    bad["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {"tcpSocket": {"port": 50051}}
    with pytest.raises(kubernetes_validate.ValidationError, match="livenesProbe"):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def test_base_renders_on_its_own() -> None:
    objects = render(K8S / "base")
    assert {o["kind"] for o in objects} >= {"Deployment", "StatefulSet", "Service", "NetworkPolicy"}


# --- inventory -----------------------------------------------------------------------------------

def test_the_objects_each_overlay_deploys(stack: Stack) -> None:
    names = sorted((o["kind"], o["metadata"]["name"].rsplit("-", 1)[0] if o["kind"] in ("ConfigMap", "Secret")
                    else o["metadata"]["name"]) for o in stack.objects)
    expected = [
        ("ConfigMap", "kvmesh-model"),
        ("Deployment", "kvmesh-kv-service"), ("Deployment", "kvmesh-router"),
        ("HorizontalPodAutoscaler", "kvmesh-router"),
        ("Namespace", "kvmesh"),
        ("NetworkPolicy", "kvmesh-kv-service"), ("NetworkPolicy", "kvmesh-redis"),
        ("NetworkPolicy", "kvmesh-router"), ("NetworkPolicy", "kvmesh-worker"),
        ("PodDisruptionBudget", "kvmesh-kv-service"), ("PodDisruptionBudget", "kvmesh-router"),
        ("PodDisruptionBudget", "kvmesh-worker"),
        *([("Secret", "kvmesh-redis")] if stack.name == "cpu-sim" else []),
        ("Service", "kvmesh-kv-service"), ("Service", "kvmesh-redis"), ("Service", "kvmesh-router"),
        ("Service", "kvmesh-worker"),
        ("StatefulSet", "kvmesh-redis"), ("StatefulSet", "kvmesh-worker"),
    ]
    assert names == expected
    for obj in stack.objects:
        if obj["kind"] != "Namespace":
            assert obj["metadata"]["namespace"] == NAMESPACE, obj["metadata"]["name"]
    assert stack.get("Deployment", "kvmesh-kv-service")["spec"]["replicas"] >= 2
    assert stack.get("StatefulSet", "kvmesh-redis")["spec"]["replicas"] == 1


# --- Services, ports, probes ---------------------------------------------------------------------

@pytest.mark.parametrize("component", COMPONENTS)
def test_service_selects_its_pods_and_ports_line_up(stack: Stack, component: str) -> None:
    service = stack.service_for(component)
    workload = stack.workload(component)
    assert selects(workload["spec"]["selector"]["matchLabels"], pod_labels(workload))
    ports = container_ports(stack.container(component))
    for port in service["spec"]["ports"]:
        assert ports[port["targetPort"]] == port["port"], f"{service['metadata']['name']} {port}"
    if workload["kind"] == "StatefulSet":
        assert workload["spec"]["serviceName"] == service["metadata"]["name"]
        assert service["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("component", ["kv-service", "router", "worker"])
def test_container_ports_equal_the_cli_ports(stack: Stack, component: str) -> None:
    args = stack.cli_args(component)
    want = {"grpc": args.port, "metrics": args.metrics_port}
    if component == "router":
        want["http"] = args.http_port  # the OpenAI-compatible API (docs/openai.md), 8000 as `kvmesh up`
    assert container_ports(stack.container(component)) == want
    defaults = build_parser(only=COMMANDS[component]).parse_args([COMMANDS[component]])
    assert (args.port, args.metrics_port) == (defaults.port, defaults.metrics_port), "ports follow CLI defaults"
    annotations = stack.workload(component)["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": str(args.metrics_port),
                           "prometheus.io/path": "/metrics"}


@pytest.mark.parametrize("component", ["kv-service", "router", "worker"])
def test_probes_use_the_grpc_port(stack: Stack, component: str) -> None:
    args = stack.cli_args(component)
    container = stack.container(component)
    found = probes(container)
    assert "readinessProbe" in found and "livenessProbe" in found
    # Readiness is grpc.health.v1 with the overall service name "" (SERVING once ready).
    assert found["readinessProbe"]["grpc"] == {"port": args.port}
    for kind, probe in found.items():
        port = probe["grpc"]["port"] if "grpc" in probe else probe["tcpSocket"]["port"]
        assert port == args.port, f"{component} {kind}"
    if component == "router":
        # NOT_SERVING while it knows no worker: that must not restart it.
        assert found["livenessProbe"]["tcpSocket"] == {"port": args.port}
    else:
        assert "grpc" in found["livenessProbe"]


def test_worker_startup_probe_waits_for_the_model(stack: Stack) -> None:
    startup = stack.container("worker")["startupProbe"]
    assert startup["grpc"] == {"port": 50061}
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= (1800 if stack.name == "gpu" else 300)


def test_redis_probes_and_port(stack: Stack) -> None:
    redis = stack.container("redis")
    assert container_ports(redis) == {"redis": 6379}
    assert redis["livenessProbe"]["tcpSocket"]["port"] == "redis"
    assert "PONG" in " ".join(redis["readinessProbe"]["exec"]["command"])


# --- args: the parts point at each other ---------------------------------------------------------

def test_kv_service_uses_the_redis_service_and_the_secret(stack: Stack) -> None:
    args = stack.cli_args("kv-service")
    redis_service = stack.service_for("redis")
    url = urlsplit(args.redis_url)
    assert (url.scheme, url.hostname, url.port) == ("redis", redis_service["metadata"]["name"],
                                                     redis_service["spec"]["ports"][0]["port"])
    redis = stack.container("redis")
    redis_password = stack.expanded_args(stack.workload("redis"), redis)
    assert redis_password[redis_password.index("--requirepass") + 1] == url.password
    assert args.store is None and args.namespace == "kvmesh"
    # The password only ever comes from a Secret, never written into a pod spec.
    for env in stack.container("kv-service")["env"] + redis["env"]:
        assert "value" not in env
    assert "$(REDIS_PASSWORD)" in " ".join(stack.container("kv-service")["args"])


def test_router_and_workers_point_at_the_kv_service(stack: Stack) -> None:
    service = stack.service_for("kv-service")
    target = f"{service['metadata']['name']}:{service['spec']['ports'][0]['port']}"
    assert stack.cli_args("router").kv_service == target
    assert stack.cli_args("worker").kv_service == target


def test_router_and_workers_serve_the_same_model(stack: Stack) -> None:
    router, worker = stack.cli_args("router"), stack.cli_args("worker")
    assert router.model_dirs and router.model_dirs == [worker.model]
    assert router.model_id and router.model_id == worker.model_id
    for component in ("router", "worker"):
        container = stack.container(component)
        volumes = {v["name"]: v for v in stack.workload(component)["spec"]["template"]["spec"]["volumes"]}
        mount = next(m for m in container["volumeMounts"] if router.model_dirs[0].startswith(m["mountPath"] + "/"))
        assert mount["name"] == "model" and mount.get("readOnly") is True, component
        if stack.name == "gpu":
            assert volumes["model"] == {"name": "model", "persistentVolumeClaim":
                                        {"claimName": "kvmesh-models", "readOnly": True}}
        else:
            # Filled by `kvmesh make-model $(MODEL_DIR)` before the server starts.
            assert set(volumes["model"]) == {"name", "emptyDir"}
            init = stack.workload(component)["spec"]["template"]["spec"]["initContainers"]
            argv = stack.expanded_args(stack.workload(component), init[0])
            assert argv == ["make-model", router.model_dirs[0]]
            build_parser(only="make-model").parse_args(argv)


def test_worker_id_is_the_pod_name_and_advertises_the_pod_ip(stack: Stack) -> None:
    args = stack.cli_args("worker")
    assert args.worker_id == "kvmesh-worker-0"
    assert args.advertise_address == f"{POD_IP}:{args.port}"
    assert args.host == "0.0.0.0"


def test_worker_flavour(stack: Stack) -> None:
    container = stack.container("worker")
    resources = container["resources"]
    argv = container["args"]
    if stack.name == "gpu":
        assert resources["limits"]["nvidia.com/gpu"] == "1"
        assert "--device=cuda" in argv and "--simulate" not in argv
        assert container["image"].endswith("-cuda")
    else:
        assert "nvidia.com/gpu" not in resources.get("limits", {})
        assert "--simulate" in argv
        assert container["image"].endswith("-cpu")
    args = stack.cli_args("worker")
    assert args.simulate is (stack.name == "cpu-sim")
    assert args.device == ("cuda" if stack.name == "gpu" else "auto")  # --simulate runs on the CPU


def test_every_kvmesh_container_uses_the_overlay_image_and_runs_as_non_root(stack: Stack) -> None:
    tag = {"gpu": "kvmesh:0.1.0-cuda", "cpu-sim": "kvmesh:0.1.0-cpu"}[stack.name]
    for workload in stack.workloads():
        spec = workload["spec"]["template"]["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["automountServiceAccountToken"] is False
        for container in spec["containers"] + spec.get("initContainers", []):
            if not container["image"].startswith("redis:"):
                assert container["image"] == tag
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert "memory" in container["resources"]["limits"]


# --- HPA, PDBs ------------------------------------------------------------------------------------

def test_hpa_scales_the_router_deployment(stack: Stack) -> None:
    hpa = stack.get("HorizontalPodAutoscaler", "kvmesh-router")
    router = stack.workload("router")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": router["kind"],
                                             "name": router["metadata"]["name"]}
    assert 2 <= hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    metric = hpa["spec"]["metrics"][0]
    assert metric["resource"]["name"] == "cpu" and metric["resource"]["target"]["type"] == "Utilization"
    # Utilization is relative to the request: without one the HPA cannot compute it.
    assert "cpu" in stack.container("router")["resources"]["requests"]


@pytest.mark.parametrize("component", ["kv-service", "router", "worker"])
def test_pdb_selects_exactly_its_workload(stack: Stack, component: str) -> None:
    pdb = stack.get("PodDisruptionBudget", f"kvmesh-{component}")
    selector = pdb["spec"]["selector"]["matchLabels"]
    matched = [w["metadata"]["name"] for w in stack.workloads() if selects(selector, pod_labels(w))]
    assert matched == [f"kvmesh-{component}"]
    replicas = stack.workload(component)["spec"]["replicas"]
    if "minAvailable" in pdb["spec"]:
        assert pdb["spec"]["minAvailable"] < replicas, "a drain must be able to evict one pod"


# --- NetworkPolicies -------------------------------------------------------------------------------

def allowed_sources(stack: Stack, component: str, port: int) -> set[str]:
    """Components whose pods may reach ``port`` of ``component`` ("*" = any source)."""
    labels = pod_labels(stack.workload(component))
    policies = [p for p in stack.all("NetworkPolicy") if selects(p["spec"]["podSelector"]["matchLabels"], labels)]
    assert len(policies) == 1, f"{component}: one NetworkPolicy expected"
    sources: set[str] = set()
    for rule in policies[0]["spec"]["ingress"]:
        if not any(p["port"] == port for p in rule["ports"]):
            continue
        if "from" not in rule:
            return {"*"}
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, "peers are pods of this namespace"
            sources |= {c for c in COMPONENTS
                        if selects(peer["podSelector"]["matchLabels"], pod_labels(stack.workload(c)))}
    return sources


def test_network_policies(stack: Stack) -> None:
    assert allowed_sources(stack, "redis", 6379) == {"kv-service"}
    assert allowed_sources(stack, "kv-service", 50052) == {"router", "worker"}
    assert allowed_sources(stack, "worker", 50061) == {"router"}
    assert allowed_sources(stack, "router", 50051) == {"*"}
    for component, metrics in (("kv-service", 9100), ("router", 9101), ("worker", 9102)):
        assert allowed_sources(stack, component, metrics) == {"*"}, "Prometheus scrapes from elsewhere"
    assert allowed_sources(stack, "redis", 9100) == set()
    for policy in stack.all("NetworkPolicy"):
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        component = policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"]
        open_ports = set(container_ports(stack.container(component)).values())
        for rule in policy["spec"]["ingress"]:
            assert {p["port"] for p in rule["ports"]} <= open_ports, policy["metadata"]["name"]


# --- docs/deploy.md's external-Redis overlay -------------------------------------------------------

def test_the_documented_external_redis_overlay(tmp_path: Path) -> None:
    docs = (K8S.parents[1] / "docs" / "deploy.md").read_text()
    snippet = re.search(r"```yaml\n# deploy/k8s/overlays/<yours>/kustomization.yaml\n(.*?)```", docs, re.S).group(1)
    gpu = os.path.relpath(K8S / "overlays" / "gpu", tmp_path)
    (tmp_path / "kustomization.yaml").write_text(snippet.replace("resources: [../gpu]", f"resources: [{gpu}]"))
    stack = Stack("gpu", render(tmp_path))
    assert [o["kind"] for o in stack.objects if o["metadata"]["name"] == "kvmesh-redis"] == []
    url = urlsplit(stack.cli_args("kv-service").redis_url)
    assert (url.scheme, url.hostname, url.port, url.password) == ("rediss", "my-redis.example.com", 6380,
                                                                  "external-password")
    for obj in stack.objects:
        kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)
