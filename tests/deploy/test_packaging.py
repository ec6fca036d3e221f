"""The wheel installs one import root, `kvmesh`, with every package folder of the repository in it.

Builds the real wheel (no network: --no-build-isolation uses the venv's setuptools), checks its
top-level entries, then installs it into a bare target directory and imports every service from
there, outside the checkout, with the editable install out of the way.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAPPED = {"kvmesh": "kvmesh", "router": "kvmesh/router", "kv_service": "kvmesh/kv_service",
          "model_worker": "kvmesh/model_worker", "kernels": "kvmesh/kernels", "bridge": "kvmesh/bridge"}
"""Repository folder -> where its files land in the wheel."""


SOURCES = ["pyproject.toml", "README.md", *MAPPED]
"""What the Dockerfile copies to build the image: the wheel must build from these alone."""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # NOTE: built from a copy, as the Dockerfile does: setuptools writes build/ into the source tree.
    src = tmp_path_factory.mktemp("src")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, cwd=out)
    (path,) = out.glob("kvmesh-*.whl")
    return path


def test_the_wheel_has_one_top_level_entry_besides_its_dist_info(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    dist_info = {t for t in top if t.endswith(".dist-info")}
    assert top - dist_info == {"kvmesh"}
    assert len(dist_info) == 1
    # no test helpers ship: they live in tests/ (tests/support/)
    assert not [n for n in names if n.rsplit("/", 1)[-1] in ("testing.py", "support.py", "conftest.py")]


def test_every_source_file_of_the_repository_packages_is_in_the_wheel(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = []
    for folder, target in MAPPED.items():
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".lua", ".pyi") or "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT / folder).as_posix()
            if f"{target}/{rel}" not in names:
                missing.append(f"{folder}/{rel}")
    assert not missing, f"not in the wheel (add the package to pyproject's [tool.setuptools] packages): {missing}"


def test_the_installed_wheel_imports_every_part_and_runs_the_cli(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    code = (
        "import kvmesh, kvmesh.router.server, kvmesh.kv_service.server, kvmesh.model_worker.serving.server, kvmesh.kernels, kvmesh.bridge.bridge\n"
        "import kvmesh.kv_service.store_redis as s\n"
        "assert sorted(s._LUA_DIR.glob('*.lua'))\n"
        "print(kvmesh.__file__)\n"
        "from kvmesh.cli import main\n"
        "main(['--help'])\n"
    )
    # -S keeps the venv's editable finder of the checkout out; the dependencies come from PYTHONPATH.
    site = [p for p in sys.path if p.endswith("site-packages")]
    env = {"PYTHONPATH": ":".join([str(target), *site]), "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=env,
                            cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0] == str(target / "kvmesh" / "__init__.py")
    assert "usage: kvmesh" in result.stdout
