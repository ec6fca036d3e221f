"""tests/ mirrors the rooms, and no test module leans on another: shared helpers live in tests/support/
or a conftest."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def test_no_test_module_imports_another_test_module():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("tests.")]
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("tests.")):
                base = "." * node.level + (node.module or "")
                names = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            found += [f"{path.relative_to(ROOT)} imports {n}" for n in names
                      if n.rstrip(".").rsplit(".", 1)[-1].startswith("test_")]
    assert not found, f"move the shared helpers to tests/support/ or a conftest: {found}"


def test_the_router_and_worker_tests_have_their_packages_rooms():
    """Every sub-folder of tests/router/ and tests/model_worker/ is a room (sub-package) of its package."""
    for package in ("router", "model_worker"):
        rooms = {p.relative_to(TESTS / package).as_posix() for p in (TESTS / package).rglob("*")
                 if p.is_dir() and p.name != "__pycache__"}
        assert rooms, f"tests/{package}/ has no rooms"
        missing = sorted(r for r in rooms if not (ROOT / package / r / "__init__.py").is_file())
        assert not missing, f"tests/{package}/ folders that are no room of {package}/: {missing}"
